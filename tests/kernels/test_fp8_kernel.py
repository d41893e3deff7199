"""FP8 GEMM and FP8 fused experts (interpreter on CPU, compiled on a GPU) against the float64
references of ``replayssm.ops.fp8.naive``: block-scaled and per-tensor weights, odd shapes
with partial edge blocks, weight-only and on-the-fly activation quantization."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

from replayssm.kernels import fp8_gemm as KF  # noqa: E402
from replayssm.kernels import moe as KM  # noqa: E402
from replayssm.ops.fp8 import naive as Q  # noqa: E402
from replayssm.ops.moe import naive as M  # noqa: E402

DEVICE = kernel_device()


def _rel(got, ref):
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("M_,N,K,block,bias,split", [
    (3, 37, 50, (16, 16), True, None),      # partial row and column blocks, K tail inside a block
    (21, 19, 64, (8, 32), False, None),     # row blocks narrower than the column tile
    (1, 48, 96, None, True, None),          # per-tensor (decode row)
    (2, 21, 150, (16, 16), True, 3),        # split-K (3 ranges of 64, 64, 22 columns), bias once
])
def test_fp8_linear_weight_only_matches_reference(M_, N, K, block, bias, split):
    g = torch.Generator().manual_seed(M_ * N + K)
    w = torch.randn(N, K, generator=g) * torch.linspace(0.1, 3, K)     # blocks of different ranges
    q, s = Q.quantize_tensor(w) if block is None else Q.quantize_block(w, block)
    x = torch.randn(M_, K + 3, generator=g)[:, 1:1 + K]                  # strided rows
    b = torch.randn(N, generator=g) if bias else None
    ref = Q.linear(x.double(), q, s, None if b is None else b.double(), block=block)
    d = lambda t: None if t is None else t.to(DEVICE)
    got = KF.linear(d(x), d(q), d(s), d(b), block=block, act_quant=False, split_k=split, block_n=16)
    assert got.shape == (M_, N) and got.dtype == torch.float32
    assert _rel(got.cpu(), ref) < 1e-5


@pytest.mark.parametrize("M_", [5, KF.PREQUANT_M + 5])     # in-tile quantization / a pass of its own
def test_fp8_linear_act_quant_exact_on_representable_activations(M_):
    """Activations whose per-token groups are powers of two times e4m3 values (each group
    holding ±448·2^j) quantize exactly under any rounding, so the FP8×FP8 path equals the
    float64 reference of the dynamic scheme (group = the kernel's K tile, 32 here)."""
    g = torch.Generator().manual_seed(1)
    N, K, block = 23, 64, (16, 32)
    w = torch.randn(N, K, generator=g)
    q, s = Q.quantize_block(w, block)
    a = torch.randn(M_, K, generator=g).clamp(-400, 400).to(Q.FP8).double()
    a[:, 0], a[:, 32] = 448.0, -448.0
    scale = 2.0 ** torch.randint(-6, 3, (M_, 2), generator=g).double().repeat_interleave(32, 1)
    x = (a * scale).float()
    ref = Q.linear_act_quant(x.double(), q, s, block=block, group=32)
    got = KF.linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), block=block, act_quant=True)
    assert _rel(got.cpu(), ref) < 1e-5


@pytest.mark.parametrize("rows", [2, KF.PREQUANT_M])
def test_fp8_linear_act_quant_on_random_activations(rows):
    """Random activations (ties and values rounding up to the next power of two included):
    the kernel's quantization (in-tile, or its own pass) is the float64 scheme's."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(33, 256, generator=g)
    q, s = Q.quantize_block(w, (32, 128))
    x = torch.randn(rows, 2, 256, generator=g)                             # leading dims kept
    got = KF.linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), block=(32, 128), act_quant=True)
    assert got.shape == (rows, 2, 33)
    assert _rel(got.cpu(), Q.linear_act_quant(x.double(), q, s, block=(32, 128), group=128)) < 1e-5
    assert _rel(got.cpu(), Q.linear(x.double(), q, s, block=(32, 128))) < 0.08     # e4m3: 3 mantissa bits


_CONFIGS = [
    KF.GemmConfig("gemv", act_quant=False, block_n=8, block_k=32, unroll=2),
    KF.GemmConfig("gemv", act_quant=False, block_n=16, block_k=64, unroll=1, split_k=2),
    KF.GemmConfig("dot", act_quant=False, block_m=16, block_n=16, block_k=32, group_m=2),
    KF.GemmConfig("dot", act_quant=False, block_m=32, block_n=16, split_k=3),
    KF.GemmConfig("dot", act_quant=True, prequant=False, block_m=16, block_n=32),
    KF.GemmConfig("dot", act_quant=True, prequant=True, block_m=32, block_n=16, group_m=3, split_k=2),
]


@pytest.mark.parametrize("block", [(32, 64), None])
@pytest.mark.parametrize("M_", [1, 3, 17, 64, 65, 200])
def test_fp8_linear_every_config_matches_reference(M_, block, nan_empty):
    """Every kernel (gemv, dot weight-only / FP8 activations in-tile / quantized beforehand,
    split-K) on odd shapes (N=37, K=150: neither a multiple of any tile), with bias, against
    the float64 reference of its scheme: weight-only -> ``linear``; FP8 activations ->
    ``linear_act_quant`` with groups of the weight's K tile (64 for block (32, 64), 128
    per-tensor).  Outputs start as NaN, so every element must be written."""
    g = torch.Generator().manual_seed(7 * M_ + (block is None))
    N, K = 37, 150
    w = torch.randn(N, K, generator=g) * torch.linspace(0.2, 2, K)
    q, s = Q.quantize_tensor(w) if block is None else Q.quantize_block(w, block)
    x = torch.randn(M_, K, generator=g)
    b = torch.randn(N, generator=g)
    ref = Q.linear(x.double(), q, s, b.double(), block=block)
    group = KF.k_tile(block)
    ref_act = Q.linear_act_quant(x.double(), q, s, b.double(), block=block, group=group).double()
    d = lambda t: t.to(DEVICE)
    for cfg in _CONFIGS:
        if cfg.kernel == "gemv" and M_ > 17:       # the decode kernel: a program per row (slow here)
            continue
        got = KF.linear(d(x), d(q), d(s), d(b), block=block, config=cfg)
        assert got.shape == (M_, N) and got.dtype == torch.float32
        assert _rel(got.cpu(), ref_act if cfg.act_quant else ref) < 1e-5, cfg.name()


@pytest.mark.parametrize("M_", [1, 17])
def test_fp8_linear_default_config_bf16(M_):
    """bf16 activations through the default table (M=1: gemv, weight-only, the reference's
    scheme; M=17: FP8 activations, the dynamic scheme), leading dims kept."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(40, 256, generator=g)
    q, s = Q.quantize_block(w, (128, 128))
    x = torch.randn(M_, 1, 256, generator=g).bfloat16()
    got = KF.linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), block=(128, 128))
    assert got.shape == (M_, 1, 40) and got.dtype == torch.bfloat16
    cfg = KF.resolve(M_, torch.bfloat16)
    ref = (Q.linear_act_quant(x.double(), q, s, block=(128, 128), group=128) if cfg.act_quant
           else Q.linear(x.double(), q, s, block=(128, 128)))
    assert _rel(got.cpu(), ref) < 1e-2                       # the bf16 rounding of the output


@pytest.mark.parametrize("rows_major", [True, False])
def test_fp8_activation_quantization_pass(rows_major):
    """The quantization pass (prefill / ``cublas`` input): bytes and scales equal the float64
    scheme's, scales in either layout (row-major, or the transpose of ``[G, M]`` that block-
    scaled ``_scaled_mm`` reads, rows padded to 16); K (300) not a multiple of the group, 5
    groups, 4 per program."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 300, generator=g) * torch.linspace(0.01, 30, 300)
    q, s = KF._quantize_rows(x.to(DEVICE), 64, rows_major, rows=None if rows_major else 16)
    R = 7 if rows_major else 16                                  # rows padded (zeros, scale 1)
    assert s.shape == (R, 5) and s.stride() == ((5, 1) if rows_major else (1, 16))
    rq, rs = Q.quantize_groups(x.double(), 64)
    assert torch.equal(s[:7].cpu(), rs) and bool((s[7:] == 1).all()) and not bool(q[7:].any())
    assert torch.equal(q[:7].cpu().view(Q.FP8).float(), rq.float())


def test_fp8_cublas_config_falls_back():
    """A ``cublas`` launch where block-scaled ``_scaled_mm`` does not apply (float32
    activations; on the CPU, not CUDA either) runs the Triton FP8-activation launch: the
    dynamic scheme's result."""
    g = torch.Generator().manual_seed(6)
    q, s = Q.quantize_block(torch.randn(24, 256, generator=g), (128, 128))
    x = torch.randn(3, 256, generator=g)
    got = KF.linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), block=(128, 128), config=KF.GemmConfig("cublas"))
    assert _rel(got.cpu(), Q.linear_act_quant(x.double(), q, s, block=(128, 128), group=128)) < 1e-5


def test_fp8_auto_split(monkeypatch):
    """K splits from the byte model (132 SMs): none with a program per SM already; enough to
    fill the SMs while the partial sums are small (decode row); fewer where they would cost
    more than the SMs they fill; each split >= 4 K tiles."""
    monkeypatch.setattr(KF, "persistent_programs", lambda device, work, per_sm: 132)
    cuda = torch.device("cuda")
    assert KF._auto_split(cuda, 200, 25, 1, 12544, 3136) == 1           # a program per SM already
    assert KF._auto_split(cuda, 16, 98, 1, 2048, 12544) == 9            # M=1: fill the SMs
    assert KF._auto_split(cuda, 49, 98, 64, 3136, 12544) == 3           # down_proj at B=64
    assert KF._auto_split(cuda, 16, 24, 64, 1024, 3136) == 6            # 4 K tiles per split at least
    assert KF._auto_split(cuda, 100, 16, 2048, 1000, 2048) == 1         # partials would dwarf the weight
    assert KF._auto_split(torch.device("cpu"), 1, 100, 1, 64, 10000) == 1


def test_fp8_config_table_and_validation(monkeypatch):
    assert KF.config_for(1) is KF.CONFIGS[min(KF.CONFIGS)]
    bounds = sorted(KF.CONFIGS)
    for lo, hi in zip(bounds, bounds[1:]):
        assert KF.config_for(lo + 1) is KF.CONFIGS[hi] and KF.config_for(hi) is KF.CONFIGS[hi]
    gemv = KF.GemmConfig("gemv", act_quant=False, block_n=4)
    assert KF.resolve(1, torch.bfloat16, config=gemv) is gemv
    assert KF.resolve(1, torch.bfloat16, act_quant=True, config=gemv).kernel == "dot"    # gemv is weight-only
    assert not KF.resolve(300, torch.float32).act_quant                                  # fp32: weight-only
    assert KF.resolve(300, torch.float32, act_quant=True).act_quant
    assert KF.resolve(300, torch.bfloat16, act_quant=False, config=KF.GemmConfig("cublas")).kernel == "dot"
    monkeypatch.setitem(KF.CONFIGS, KF.ANY_M, KF.GemmConfig("cublas"))      # a table whose prefill is cublas
    fb = KF.resolve(5000, torch.bfloat16, act_quant=False)
    assert fb.kernel == "dot" and not fb.act_quant and fb.block_m == KF._PREFILL_DOT.block_m
    for bad in (dict(kernel="tiles"), dict(kernel="gemv"), dict(block_n=48), dict(block_m=8),
                dict(num_warps=3), dict(split_k=-1), dict(unroll=0), dict(unroll=3)):
        with pytest.raises(ValueError):
            KF.GemmConfig(**bad)


def test_fp8_linear_bad_input():
    q, s = Q.quantize_block(torch.randn(8, 32), (8, 16))
    with pytest.raises(ValueError, match="scale has shape"):
        KF.linear(torch.randn(2, 32), q, s[:, :1], block=(8, 16))
    with pytest.raises(ValueError, match="features"):
        KF.linear(torch.randn(2, 31), q, s, block=(8, 16))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        KF.linear(torch.randn(2, 32), q.float(), s, block=(8, 16))
    assert KF.k_tile((128, 8)) is None and KF.k_tile((128, 96)) == 32 and KF.k_tile(None) == 128


@pytest.mark.parametrize("gated,act,block", [(True, "silu", (8, 16)), (False, "relu2", (16, 32)),
                                             (True, "silu", None)])
def test_fp8_fused_experts_match_reference(gated, act, block):
    g = torch.Generator().manual_seed(3)
    N, D, I, E, k, DO = 7, 40, 12, 5, 2, 40
    x = torch.randn(N, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=g)
    w1 = torch.randn(E, (2 if gated else 1) * I, D, generator=g)
    w2 = torch.randn(E, DO, I, generator=g)
    q1, s1 = Q.quantize_experts(w1, block, 2 if gated else 1)
    q2, s2 = Q.quantize_experts(w2, block, 1)
    kw = dict(act=act, gated=gated, w1_scale=s1, w2_scale=s2, block=block)
    ref = M.experts(x.double(), idx, w.double(), q1, q2, **kw)
    dq1 = Q.dequantize_experts(q1, s1, block, 2 if gated else 1, torch.float64)
    dq2 = Q.dequantize_experts(q2, s2, block, 1, torch.float64)
    plain = M.experts(x.double(), idx, w.double(), dq1, dq2, act=act, gated=gated)
    assert torch.equal(ref, plain)                                   # the reference dequantizes
    d = lambda t: t.to(DEVICE)
    kq = dict(act=act, gated=gated, w1_scale=d(s1), w2_scale=d(s2), block=block)
    got = KM.experts(d(x), d(idx), d(w), d(q1), d(q2), **kq, act_quant=False)
    assert _rel(got.cpu(), ref) < 1e-5
    got = KM.experts(d(x), d(idx), d(w), d(q1), d(q2), **kq, act_quant=True)     # FP8 x FP8 products
    bk = 1 << 30 if block is None else block[1]             # the kernel's K tiles (64, 16 here): the groups
    want = _experts_act_quant(x, idx, w, q1, s1, q2, s2, block, gated, act, min(64, bk), min(16, bk))
    assert _rel(got.cpu(), want) < 1e-5
    assert _rel(got.cpu(), ref) < 0.1


def _experts_act_quant(x, idx, w, q1, s1, q2, s2, block, gated, act, g1, g2):
    """float64 emulation of the kernel's FP8 x FP8 experts: token rows quantized per group of
    ``g1`` channels, ``h`` (rounded to x's dtype) per group of ``g2``."""
    parts = 2 if gated else 1
    d1 = Q.dequantize_experts(q1, s1, block, parts, torch.float64)
    d2 = Q.dequantize_experts(q2, s2, block, 1, torch.float64)
    f = M.activation(act)
    out = torch.zeros(x.shape[0], d2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        xa = Q.dequantize_groups(*Q.quantize_groups(x[t:t + 1].double(), g1), g1)
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            u = xa @ d1[e].T
            h = f(u[:, :u.shape[1] // 2]) * u[:, u.shape[1] // 2:] if gated else f(u)
            h = h.to(x.dtype).double()
            out[t] += float(w[t, j]) * (Q.dequantize_groups(*Q.quantize_groups(h, g2), g2) @ d2[e].T)[0]
    return out


def test_fp8_experts_bad_input():
    w1, w2 = torch.randn(3, 8, 16), torch.randn(3, 16, 4)
    q1, s1 = Q.quantize_experts(w1, (4, 16), 2)
    q2, s2 = Q.quantize_experts(w2, (4, 16), 1)
    x, idx, w = torch.randn(2, 16), torch.tensor([[0], [2]]), torch.ones(2, 1)
    with pytest.raises(ValueError, match="w1_scale"):
        KM.experts(x, idx, w, q1, q2, w1_scale=s1[:, :1], w2_scale=s2, block=(4, 16))
    with pytest.raises(ValueError, match="expert scales have shape"):
        M.experts(x, idx, w, q1, q2, w1_scale=s1[:, :1], w2_scale=s2, block=(4, 16))
    with pytest.raises(ValueError, match="both w1 and w2"):
        M.experts(x, idx, w, q1, q2, w1_scale=s1, block=(4, 16))


_STREAM = [
    KF.GemmConfig("stream", act_quant=False, block_m=4, block_n=8, block_k=32, split_k=3, reduce="sum"),
    KF.GemmConfig("stream", act_quant=False, block_m=2, block_n=16, split_k=2, reduce="atomic"),
    KF.GemmConfig("stream", act_quant=False, block_m=8, block_n=4, block_k=64, split_k=3, reduce="fixup"),
    KF.GemmConfig("stream", act_quant=False, block_m=1, block_n=16, waves=2),              # split from the grid
    KF.GemmConfig("stream", act_quant=False, block_m=16, block_n=16, block_k=32, split_k=3, reduce="fixup"),
    KF.GemmConfig("stream", act_quant=False, block_m=64, block_n=32, split_k=2, reduce="sum"),
]


@pytest.mark.parametrize("M_,N,K,block", [
    (1, 37, 300, (128, 128)),      # the checkpoint block; K ends inside a block (300 = 2·128 + 44)
    (3, 45, 150, (16, 64)),        # odd N and K, partial edge blocks
    (16, 21, 96, (8, 32)),         # row blocks narrower than the column tile: a scale per row
    (17, 37, 160, None),           # per-tensor
    (64, 19, 128, (128, 128)),
])
def test_fp8_stream_matches_reference(M_, N, K, block, nan_empty):
    """The ``stream`` decode kernel (FMA and ``tl.dot`` forms, every reduction of the K ranges,
    the automatic split) equals the float64 reference of the weight-only scheme, with bias,
    strided rows and NaN-poisoned outputs; the ``fixup`` counters are left zero."""
    g = torch.Generator().manual_seed(M_ * 131 + N + K)
    w = torch.randn(N, K, generator=g) * torch.linspace(0.1, 3, K)
    q, s = Q.quantize_tensor(w) if block is None else Q.quantize_block(w, block)
    x = torch.randn(M_, K + 5, generator=g)[:, 2:2 + K]                  # strided rows
    b = torch.randn(N, generator=g)
    ref = Q.linear(x.double(), q, s, b.double(), block=block)
    d = lambda t: t.to(DEVICE)
    for cfg in _STREAM:
        got = KF.linear(d(x), d(q), d(s), d(b), block=block, config=cfg)
        assert got.shape == (M_, N) and got.dtype == torch.float32
        assert _rel(got.cpu(), ref) < 1e-5, cfg.name()
        if cfg.reduce == "fixup":
            assert not KF._counters(torch.device(DEVICE)).any()
    got = KF.linear(d(x), d(q), d(s), None, block=block, config=_STREAM[2])          # no bias
    assert _rel(got.cpu(), Q.linear(x.double(), q, s, block=block)) < 1e-5


def test_fp8_stream_bf16_rows_and_plan():
    """bf16 activations (output rounded to bf16; leading dims kept) and the launch plan: rows
    per program capped by ``M`` (FMA) or padded to 16 (``tl.dot``), the split filling the
    SMs' waves with at least two K tiles per range, the fixup falling back past its counters."""
    g = torch.Generator().manual_seed(9)
    q, s = Q.quantize_block(torch.randn(40, 384, generator=g), (128, 128))
    x = torch.randn(3, 1, 384, generator=g).bfloat16()
    cfg = KF.GemmConfig("stream", act_quant=False, block_m=8, block_n=8, split_k=2, reduce="atomic")
    got = KF.linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), block=(128, 128), config=cfg)
    assert got.shape == (3, 1, 40) and got.dtype == torch.bfloat16
    assert _rel(got.cpu(), Q.linear(x.double(), q, s, block=(128, 128))) < 1e-2
    cpu = torch.device("cpu")
    fma = KF.GemmConfig("stream", act_quant=False, block_m=8, block_n=16, waves=4)
    p = KF.stream_plan(3, 3136, 7680, fma, 128, cpu)
    assert (p["dot"], p["BM"], p["BN"], p["BK"], p["tiles"]) == (False, 4, 16, 128, 196) and p["S"] == 1
    dot = KF.GemmConfig("stream", act_quant=False, block_m=64, block_n=64, split_k=5, reduce="fixup")
    p = KF.stream_plan(3, 100, 1000, dot, 64, cpu)
    assert (p["dot"], p["BM"], p["BK"], p["KS"], p["S"], p["reduce"]) == (True, 16, 64, 256, 4, 3)
    assert KF.stream_split(cpu, 1, 98, 8) == 8 and KF.stream_split(cpu, 1, 3, 8) == 1
    assert KF.stream_split(cpu, 1, 1000, 64) == 64 and KF.stream_split(cpu, 20, 98, 8) == 1
    big = KF.stream_plan(1, 16 * KF.COUNTER_SLOTS + 16, 512, replace(dot, block_n=16), 128, cpu)
    assert big["reduce"] == 1                                   # more tiles than counters: summing launch


def test_fp8_stream_grid_past_65535_rows(monkeypatch):
    """The launch grid is one axis (programs = row tiles × column tiles × K ranges, decoded in
    the kernel), so 70000 decode rows of one column tile fit where CUDA's axes 1 and 2 stop at
    65535 (the interpreter has no such limit, so the launch is recorded, not run)."""
    seen = []

    class Rec:
        def __getitem__(self, grid):
            seen.append(grid)
            return lambda *a, **k: None

    monkeypatch.setattr(KF, "_stream_kernel", Rec())
    q, s = Q.quantize_block(torch.randn(3, 32), (16, 16))
    cfg = KF.GemmConfig("stream", act_quant=False, block_m=1, block_n=4, split_k=2, reduce="fixup")
    KF.linear(torch.randn(70000, 32), q, s, block=(16, 16), config=cfg)
    assert seen == [(70000 * 2,)]


def test_fp8_tune_table_and_shape_entries(monkeypatch, tmp_path):
    """A tune table (JSON file or dict) joins the bucket table; its per-shape entries win for
    their (bucket, N, K); bad tables are refused before anything changes; FP8 activations on a
    ``stream`` entry go to the FP8-activation decode launch."""
    monkeypatch.setattr(KF, "CONFIGS", dict(KF.CONFIGS))
    monkeypatch.setattr(KF, "SHAPE_CONFIGS", {})
    st = KF.GemmConfig("stream", act_quant=False, block_m=4, block_n=16, reduce="fixup", waves=8)
    st2 = KF.GemmConfig("stream", act_quant=False, block_m=16, block_n=64, split_k=4)
    table = {"buckets": {"4": st.to_dict()}, "shapes": [{"bucket": 4, "N": 3136, "K": 7680, "config": st2.to_dict()}]}
    path = tmp_path / "t.json"
    path.write_text(__import__("json").dumps(table))
    KF.use_table(str(path))
    assert KF.CONFIGS[4] == st and KF.config_for(3) == st and KF.config_for(3, N=3136, K=7680) == st2
    assert KF.config_for(5, N=3136, K=7680) is KF.CONFIGS[16]
    assert KF.resolve(3, torch.bfloat16, N=3136, K=7680) == st2
    assert KF.resolve(3, torch.bfloat16, act_quant=True).kernel == "dot"
    assert KF.GemmConfig.from_dict(st.to_dict()) == st
    before = dict(KF.CONFIGS)
    for bad in ({"buckets": {"4": {"kernel": "stream", "tile": 3}}}, {"buckets": {"0": st.to_dict()}}, {"rows": {}},
                {"buckets": {"4": st.to_dict()}, "shapes": [{"N": 1}]}, {"buckets": {"4": {"kernel": "stream"}}}):
        with pytest.raises(ValueError):
            KF.use_table(bad)
    with pytest.raises(ValueError, match="any"):
        KF.use_table({"buckets": {"4": st.to_dict()}}, merge=False)
    assert KF.CONFIGS == before
    for bad in (dict(kernel="stream", act_quant=False, reduce="tree"), dict(kernel="stream", act_quant=False, waves=0),
                dict(kernel="stream", act_quant=False, block_m=3), dict(kernel="stream", act_quant=False, block_m=16,
                                                                         block_n=8), dict(kernel="stream")):
        with pytest.raises(ValueError):
            KF.GemmConfig(**bad)


def test_fp8_prefill_k_padding_keeps_the_sums():
    """The ``pad`` prefill fallback's operands (K = 300 padded to 512: zero weight bytes, scale 1
    for the added blocks; activations quantized into 512 columns, zeros and scale 1 past K)
    give, in float64, exactly the FP8-activation reference; no column past K is non-zero."""
    g = torch.Generator().manual_seed(12)
    N, K, Kp = 48, 300, 512
    q, s = Q.quantize_block(torch.randn(N, K, generator=g), (128, 128))
    x = torch.randn(5, K, generator=g)
    wp, sp = KF._pad_k(q.to(DEVICE), s.to(DEVICE), Kp, 128)
    assert wp.shape == (N, Kp) and sp.shape == (1, 4) and float(sp[0, 3]) == 1.0
    assert not wp.view(torch.uint8)[:, K:].any() and torch.equal(wp.cpu()[:, :K].view(torch.uint8), q.view(torch.uint8))
    qa, sa = KF._quantize_rows(x.to(DEVICE), 128, False, rows=16, cols=Kp)
    assert qa.shape == (16, Kp) and sa.shape == (16, 4) and not qa[:, K:].any() and bool((sa[:, 3] == 1).all())
    a = Q.dequantize_groups(qa.cpu().view(Q.FP8), sa.cpu(), 128)[:5]
    got = a @ Q.dequantize_block(wp.cpu(), sp.cpu(), (128, 128), torch.float64).T
    assert _rel(got, Q.linear_act_quant(x.double(), q, s, block=(128, 128), group=128)) < 1e-12


@pytest.mark.parametrize("block", [(128, 128), (16, 32), None])
def test_fp8_dequantize_kernel_and_dequant_fallback(block, monkeypatch):
    """``dequantize`` equals the float64 reference cast to fp32 exactly (q has 4 significant
    bits: the fp32 product is exact); the ``dequant`` prefill fallback of a ``cublas`` launch is
    the weight-only reference; an unknown fallback is refused."""
    g = torch.Generator().manual_seed(13)
    w = torch.randn(37, 150, generator=g) * torch.linspace(0.1, 4, 150)
    q, s = Q.quantize_tensor(w) if block is None else Q.quantize_block(w, block)
    got = KF.dequantize(q.to(DEVICE), s.to(DEVICE), block, torch.float32).cpu()
    want = Q.dequantize_tensor(q, s) if block is None else Q.dequantize_block(q, s, block)
    assert torch.equal(got, want)
    x, b = torch.randn(4, 150, generator=g), torch.randn(37, generator=g)
    monkeypatch.setattr(KF, "CUBLAS_K_FALLBACK", "dequant")
    y = KF.linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), b.to(DEVICE), block=block,
                  config=KF.GemmConfig("cublas"), act_quant=True)
    assert _rel(y.cpu(), Q.linear(x.double(), q, s, b.double(), block=block)) < 1e-5
    monkeypatch.setattr(KF, "CUBLAS_K_FALLBACK", "fast")
    with pytest.raises(ValueError, match="CUBLAS_K_FALLBACK"):
        KF.linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), block=block, config=KF.GemmConfig("cublas"))
