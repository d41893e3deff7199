"""The layers reach the Triton kernels through ``kernels.dispatch.ops_for``.

Whole models (a tiny Mamba-2 and a tiny Qwen3-Next with a GDN layer and an attention layer)
run prefill, replay decode (through a flush), replay verify + commit, tree verify + commit,
KV-only decode / verify / tree, a KV -> state switch (mixed form) and the recurrent
baseline, once with the naive ops (``REPLAYSSM_KERNELS=naive``) and once with the kernels
(``REPLAYSSM_KERNELS=triton``): logits and every cache tensor (except the null slot / null
block, which hold garbage) must agree in float32.  On CPU the kernels run in the Triton
interpreter (``TRITON_INTERPRET=1`` from ``conftest.py``), so shapes stay tiny.
"""

from __future__ import annotations

import functools
import inspect
import sys

import pytest
import torch
from torch import nn

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

from replayssm.kernels import dispatch  # noqa: E402
from replayssm.models.registry import parse_config  # noqa: E402
from replayssm.models.kimi_linear import KimiLinearLM  # noqa: E402
from replayssm.models.mamba2 import Mamba2LM  # noqa: E402
from replayssm.models.qwen3_next import Qwen3NextLM  # noqa: E402

DEVICE = kernel_device()

ATOL, RTOL = 1e-5, 1e-4

CONFIGS = {
    "mamba2": (Mamba2LM, dict(model_type="mamba2", vocab_size=19, hidden_size=8, num_heads=2, head_dim=4,
                              state_size=8, n_groups=1, expand=1, num_hidden_layers=1, conv_kernel=3,
                              chunk_size=8, tie_word_embeddings=False)),
    # layer 0: Gated DeltaNet (1 key head, 2 value heads: GVA), layer 1: gated attention
    "qwen3_next": (Qwen3NextLM, dict(model_type="qwen3_next", vocab_size=19, hidden_size=8, num_hidden_layers=2,
                                     full_attention_interval=2, num_attention_heads=2, num_key_value_heads=1,
                                     head_dim=8, intermediate_size=8, linear_num_key_heads=1,
                                     linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4,
                                     linear_conv_kernel_dim=3, num_experts=0, tie_word_embeddings=False)),
    # layer 0: KDA (2 heads of 4), layer 1: MLA (latent 6, rope part 2, no rope applied)
    "kimi_linear": (KimiLinearLM, dict(model_type="kimi_linear", vocab_size=19, hidden_size=8, num_hidden_layers=2,
                                       layer_types=["linear_attention", "full_attention"],
                                       mlp_layer_types=["dense", "dense"], intermediate_size=8,
                                       num_attention_heads=2, kv_lora_rank=6, qk_nope_head_dim=4,
                                       qk_rope_head_dim=2, v_head_dim=4, linear_attn_config=dict(
                                           num_heads=2, head_dim=4, short_conv_kernel_size=3))),
}


@functools.lru_cache(maxsize=None)
def tiny_model(name: str, dtype: torch.dtype = torch.float32):
    """A random-weight model built in memory (no checkpoint round trip)."""
    cls, d = CONFIGS[name]
    with torch.device("meta"):
        m = cls(parse_config(d), dtype, DEVICE)
    g = torch.Generator().manual_seed(1)
    for pname, p in list(m.named_parameters()):
        mod_name, _, leaf = pname.rpartition(".")
        t = 0.3 * torch.randn(p.shape, generator=g)
        if leaf == "A_log":
            t = torch.empty(p.shape).uniform_(0.0, 1.5, generator=g)
        elif leaf == "dt_bias":
            t = torch.empty(p.shape).uniform_(-2.0, 0.0, generator=g)
        elif pname.endswith("norm.weight") or pname.endswith("norm_f.weight"):
            t = 0.1 * torch.randn(p.shape, generator=g) + (1.0 if cls is Mamba2LM else 0.0)
        m.get_submodule(mod_name)._parameters[leaf] = nn.Parameter(t.to(DEVICE, dtype), requires_grad=False)
    return m.eval()


def cache_tensors(cache) -> dict:
    """Every cache tensor without its null row (slot 0 / paged block 0 hold garbage)."""
    out = {"seq_len": cache.seq_len, "ring.start": cache.ring.start, "ring.length": cache.ring.length}
    skip = {"seq_len": 1, "ring.start": 1, "ring.length": 1}
    if cache.pidx is not None:
        out["pidx.length"], skip["pidx.length"] = cache.pidx.length, 1
    for lid, store in cache.layers.items():
        for k, v in store.items():
            if isinstance(v, torch.Tensor):
                out[f"{lid}.{k}"], skip[f"{lid}.{k}"] = v, 1
            elif v is not None:
                for n, t in vars(v).items():
                    if isinstance(t, torch.Tensor):
                        key = f"{lid}.{k}.{n}"
                        out[key] = t
                        skip[key] = cache.spec.block_size if k == "kv" else 1
    return {k: v[skip[k]:].clone() for k, v in out.items()}


def run_scenario(model, mode: str):
    """Prefill, decodes through a ring flush, a verify and a tree verify with their commits,
    more decodes; in KV mode also a switch of one slot to state form (mixed steps).
    Returns (logits per step, cache tensors after each phase)."""
    g = torch.Generator().manual_seed(0)
    V = model.vocab_size
    cache = model.make_cache(4, mode=mode, buffer_size=4, max_new=2, max_seq_len=24, block_size=4)
    dev = cache.device
    slots = torch.tensor([1, 0, 2], device=dev)                 # row 1 pads (null slot)

    def ids(*shape):
        return torch.randint(0, V, shape, generator=g).to(dev)

    logits, snaps = [], []
    logits.append(model.prefill(cache, slots, ids(3, 5), torch.tensor([3, 1, 5], device=dev)))
    for _ in range(5):                                           # L = 4: every row flushes
        logits.append(model.decode(cache, slots, ids(3)))
    snaps.append(cache_tensors(cache))
    logits.append(model.verify(cache, slots, ids(3, 2)))
    model.commit(cache, torch.tensor([2, 0, 1], device=dev))
    snaps.append(cache_tensors(cache))
    parent = torch.tensor([[-1, 0], [-1, 0], [-1, -1]], device=dev)
    logits.append(model.verify_tree(cache, slots, ids(3, 2), parent))
    model.commit(cache, torch.tensor([2, 0, 1], device=dev), torch.tensor([[0, 1], [0, 1], [1, 0]], device=dev))
    snaps.append(cache_tensors(cache))
    for _ in range(2):
        logits.append(model.decode(cache, slots, ids(3)))
    if mode == "kv":
        cache.switch_to_state([2])                               # slot 2 -> replay, slot 1 stays KV
        assert cache.ssm_form() == "mixed"
        for _ in range(2):
            logits.append(model.decode(cache, slots, ids(3)))
        logits.append(model.verify(cache, slots, ids(3, 2)))
        model.commit(cache, torch.tensor([1, 0, 2], device=dev))
    snaps.append(cache_tensors(cache))
    return logits, snaps


@pytest.fixture
def kernel_calls(monkeypatch):
    """Count calls of each routed kernel wrapper (``{(family, op): n}``)."""
    calls: dict = {}
    for fam, names in [(f, dispatch.ROUTED[f]) for f in ("mamba2", "gdn", "kda")] + [("attention", ("mla_attention",))]:
        for name in names:
            f = dispatch.kernel_for(fam, name)
            mod = sys.modules[f.__module__]

            def spy(*a, _f=f, _key=(fam, name), **kw):
                calls[_key] = calls.get(_key, 0) + 1
                return _f(*a, **kw)

            monkeypatch.setattr(mod, name, functools.wraps(f)(spy))
    return calls


EXPECTED = {  # kernels each mode must reach
    "replay": {"replay_decode", "replay_verify", "tree_verify"},
    "kv": {"kv_verify", "replay_decode", "replay_verify"},   # mixed rows; KV trees: kv_tree_verify (reference)
    "recurrent": {"recurrent_step", "snapshot_verify"},
}


#: kernels each mode must reach in a KDA layer (the replay and KV-only decode forms have kernels)
EXPECTED_KDA = {"replay": {"replay_decode", "replay_verify", "tree_verify"},
                "kv": {"kv_verify", "kv_tree_verify", "replay_decode", "replay_verify"}}


@pytest.mark.parametrize("mode,name", [(m, n) for n in ("mamba2", "qwen3_next") for m in ("replay", "kv", "recurrent")]
                         + [("replay", "kimi_linear"), ("kv", "kimi_linear")])
def test_layers_kernels_match_naive(name, mode, kernels_env, kernel_calls):
    model = tiny_model(name)
    fam = {"mamba2": "mamba2", "qwen3_next": "gdn", "kimi_linear": "kda"}[name]
    expected = EXPECTED_KDA[mode] if fam == "kda" else EXPECTED[mode]
    res = {}
    for backend in ("naive", "triton"):
        kernels_env(backend)
        kernel_calls.clear()
        res[backend] = run_scenario(model, mode)
        used = {op for (f, op) in kernel_calls if f == fam}
        if backend == "naive":
            assert not kernel_calls, f"naive run called kernels: {kernel_calls}"
        else:
            assert expected <= used, f"{mode}: kernels {sorted(expected - used)} never ran"
            if name == "kimi_linear":   # the MLA layer's decode / verify / tree steps
                assert kernel_calls.get(("attention", "mla_attention"), 0) >= 9, kernel_calls
    (lg_n, sn_n), (lg_t, sn_t) = res["naive"], res["triton"]
    assert len(lg_n) == len(lg_t)
    real = [0, 2]  # row 1 pads on the null slot: its logits are garbage (racy on a GPU)
    for i, (a, b) in enumerate(zip(lg_n, lg_t)):
        a, b = a[real], b[real]
        assert torch.isfinite(b).all(), f"step {i}: non-finite kernel logits"
        torch.testing.assert_close(b, a, atol=ATOL, rtol=RTOL, msg=lambda m, i=i: f"logits of step {i}: {m}")
    for phase, (a, b) in enumerate(zip(sn_n, sn_t)):
        assert a.keys() == b.keys()
        for k in a:
            if a[k].is_floating_point():
                torch.testing.assert_close(b[k], a[k], atol=ATOL, rtol=RTOL, equal_nan=True,
                                           msg=lambda m, k=k, p=phase: f"cache {k} after phase {p}: {m}")
            else:
                assert torch.equal(a[k], b[k]), f"cache {k} after phase {phase} differs"


def test_ops_for_exposes_naive_and_routes():
    from replayssm.kernels import gdn as KG
    from replayssm.kernels import mamba2 as K2
    from replayssm.layers.gdn import GatedDeltaNet
    from replayssm.layers.mamba2 import Mamba2Mixer
    from replayssm.ops.gdn import naive as NG
    from replayssm.ops.mamba2 import naive as N2

    for fam, naive, kern in (("mamba2", N2, K2), ("gdn", NG, KG)):
        ops = dispatch.ops_for(fam)
        assert ops is dispatch.ops_for(fam)
        for name in ("chunked_prefill", "kv_to_state", "snapshot_commit", "recurrent_scan"):
            assert getattr(ops, name) is getattr(naive, name)
        for name in dispatch.ROUTED[fam]:
            # every keyword the naive op takes (what the layers pass) is accepted by the kernel,
            # and the positional arguments line up
            pn = inspect.signature(getattr(naive, name)).parameters
            pk = inspect.signature(dispatch.kernel_for(fam, name)).parameters
            missing = [p for p in pn if p not in pk]
            assert not missing, f"{fam}.{name}: kernel lacks {missing}"
            assert list(pk)[: len(pn)] == list(pn), f"{fam}.{name}: argument order differs"
        with pytest.raises(AttributeError):
            ops.no_such_op
    m = tiny_model("mamba2")
    q = tiny_model("qwen3_next")
    assert isinstance(m.blocks[0].mixer, Mamba2Mixer) and m.blocks[0].mixer.ops() is dispatch.ops_for("mamba2")
    assert isinstance(q.blocks[0].linear_attn, GatedDeltaNet)
    assert q.blocks[0].linear_attn.ops() is dispatch.ops_for("gdn")


def test_naive_path_drops_kernel_only_keywords(kernels_env):
    from replayssm.cache.buffers import Mamba2Buffers
    from replayssm.cache.ring import RingIndex

    kernels_env("naive")
    ring = RingIndex(2, 4, "cpu")
    buf = Mamba2Buffers.allocate(2, 4, 2, 3, 4, 1)
    plan = ring.plan_decode(torch.tensor([1, 2]))
    x, dt, A = torch.randn(2, 2, 3), torch.rand(2, 2), -torch.rand(2)
    B, C = torch.randn(2, 1, 4), torch.randn(2, 1, 4)
    y = dispatch.ops_for("mamba2").replay_decode(buf, plan, x, dt, A, B, C, None, block_d=16, num_warps=2,
                                                 pre_scores=True, precision="ieee")
    assert y.shape == (2, 2, 3)


def test_auto_keeps_float64_on_the_naive_ops(monkeypatch, kernels_env):
    """``backend="auto"``: fp64 calls never pick the (fp32) kernels; the env override still
    wins.  The choice is made once per (device, dtype) of the lead tensor, not per call."""
    seen = []

    def spy(*tensors, backend="auto"):
        seen.append(backend)
        return False

    monkeypatch.setattr(dispatch, "use_triton", spy)
    kernels_env(None)
    ops = dispatch.KernelOps("mamba2")
    st32, st64 = torch.zeros(2, 1, 1, 1), torch.zeros(2, 1, 1, 1, dtype=torch.float64)
    x32, x64 = torch.randn(2, 1, 1), torch.randn(2, 1, 1, dtype=torch.float64)
    args = lambda x: (x[:, :, 0] * 0 + 0.5, -torch.ones(1, dtype=x.dtype), torch.randn(2, 1, 1, dtype=x.dtype),
                      torch.randn(2, 1, 1, dtype=x.dtype))
    ops.recurrent_step(st32, x32, *args(x32))
    ops.recurrent_step(st64, x64, *args(x64))
    ops.recurrent_step(st32, x32, *args(x32))                     # resolved: no new choice
    ops.recurrent_step(st64, x64, *args(x64))
    assert seen == ["auto", "naive"]
    monkeypatch.setenv("REPLAYSSM_KERNELS", "triton")
    ops.recurrent_step(st64, x64, *args(x64))
    assert seen == ["auto", "naive"], "the environment is read once per resolution"
    kernels_env("triton")                                         # reset: read again
    ops.recurrent_step(st64, x64, *args(x64))
    assert seen == ["auto", "naive", "auto"]


def test_every_op_is_routed_or_declared_reference_only():
    """No op reaches the reference silently on CUDA: each public op of a family's reference
    module is either routed to a kernel or listed as reference-only, and that list is this."""
    from replayssm.ops.attention import naive as NA
    from replayssm.ops.conv import naive as NC
    from replayssm.ops.fp8 import naive as NF
    from replayssm.ops.gates import naive as NT
    from replayssm.ops.gdn import naive as NG
    from replayssm.ops.mamba2 import naive as N2
    from replayssm.ops.kda import naive as NK
    from replayssm.ops.moe import naive as NM

    for fam, naive in (("mamba2", N2), ("gdn", NG), ("kda", NK), ("conv", NC), ("attention", NA), ("moe", NM),
                       ("fp8", NF), ("gates", NT)):
        routed, ref = set(dispatch.ROUTED[fam]), set(dispatch.REFERENCE_ONLY[fam])
        ops = {n for n in naive.__all__ if callable(getattr(naive, n))}
        assert not routed & ref, fam
        assert routed | ref == ops, f"{fam}: unclassified {ops - routed - ref}"
    assert dispatch.REFERENCE_ONLY == {
        "mamba2": ("segsum", "recurrent_scan", "chunked_prefill", "snapshot_commit", "kv_to_state",
                   "kv_tree_verify"),
        "gdn": ("l2norm", "recurrent_scan", "chunked_prefill", "snapshot_commit", "kv_to_state",
                "kv_tree_verify"),
        # KDA: kernels for the replay and KV-only decode forms
        "kda": ("l2norm", "recurrent_step", "recurrent_update", "recurrent_scan", "chunked_prefill",
                "chunked_prefill_varlen", "rebuild_state", "snapshot_verify", "snapshot_commit", "kv_fold",
                "kv_to_state"),
        "conv": ("conv_prefill", "conv_tree", "conv_commit_tree", "conv_window_out"),
        "attention": ("token_positions", "new_slots", "check_paged", "check_write", "check_mla"),
        "moe": ("activation", "check_experts"),
        "fp8": ("quantize_block", "dequantize_block", "quantize_tensor", "dequantize_tensor", "quantize_groups",
                "dequantize_groups", "expand_scale", "scale_grid", "quantize_experts", "dequantize_experts",
                "expert_scale_shape", "linear_act_quant", "check_block"),
        "gates": ("check_gates", "clamps"),
    }


def test_routed_op_without_kernel_raises_naming_it(monkeypatch):
    """An op routed to the kernels whose kernel is missing raises (naming it) rather than
    running the reference: only ``REFERENCE_ONLY`` ops run the reference where kernels run."""
    from replayssm.kernels import mamba2 as K2

    monkeypatch.delattr(K2, "recurrent_step")
    st, x = torch.zeros(2, 1, 1, 1, device=DEVICE), torch.randn(2, 1, 1, device=DEVICE)
    args = (torch.full((2, 1), 0.5, device=DEVICE), -torch.ones(1, device=DEVICE), torch.randn(2, 1, 1, device=DEVICE),
            torch.randn(2, 1, 1, device=DEVICE))
    with pytest.raises(NotImplementedError, match=r"mamba2\.recurrent_step"):
        dispatch.KernelOps("mamba2", backend="triton").recurrent_step(st, x, *args)
    dispatch.KernelOps("mamba2", backend="naive").recurrent_step(st, x, *args)   # the reference needs none


def _probe(args, kwargs) -> list:
    """Every tensor of a call that could decide its backend: tensor arguments, and the state
    (ring buffers), window (conv) or first pool tensor (paged pools) of cache objects."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(getattr(a, "state", None), torch.Tensor):
            out.append(a.state)
        elif isinstance(getattr(a, "window", None), torch.Tensor):
            out.append(a.window)
        elif hasattr(a, "tensors") and callable(a.tensors):
            out += [t for t in a.tensors() if isinstance(t, torch.Tensor)][:1]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["mamba2", "qwen3_next"])
def test_lead_tensor_decides_like_every_tensor(name, dtype, monkeypatch, kernels_env):
    """The table key is the lead tensor's (device, dtype): in every routed call the layers make
    (each form, prefill to commit), all the call's tensors share the lead's device type, and
    one of them is float64 exactly when the lead is, so the lead decides as all of them would."""
    from replayssm.ops.attention import naive as NA
    from replayssm.ops.conv import naive as NC
    from replayssm.ops.fp8 import naive as NF
    from replayssm.ops.gdn import naive as NG
    from replayssm.ops.mamba2 import naive as N2
    from replayssm.ops.moe import naive as NM

    kernels_env(None)
    seen = set()
    for fam, naive in (("mamba2", N2), ("gdn", NG), ("conv", NC), ("attention", NA), ("moe", NM), ("fp8", NF)):
        for op in dispatch.ROUTED[fam]:
            for mod in {naive, dispatch.kernel_module(fam, op)}:
                f = getattr(mod, op)

                def spy(*a, _f=f, _key=(fam, op), **kw):
                    ts = _probe(a, kw)
                    lead = ts[0]
                    assert {t.device.type for t in ts} == {lead.device.type}, f"{_key}: mixed devices"
                    assert any(t.dtype == torch.float64 for t in ts) == (lead.dtype == torch.float64), \
                        f"{_key}: float64 beside a {lead.dtype} lead"
                    seen.add(_key)
                    return _f(*a, **kw)

                monkeypatch.setattr(mod, op, functools.wraps(f)(spy))
    model = tiny_model(name, dtype)
    for mode in ("replay", "kv", "recurrent"):
        run_scenario(model, mode)
    assert {("mamba2" if name == "mamba2" else "gdn", "replay_decode"), ("conv", "conv_decode")} <= seen


@pytest.mark.parametrize("fam", ["mamba2", "gdn"])
def test_long_kv_only_steps_run_the_reference(fam, monkeypatch, kernels_env):
    """A KV-only step of more than ``KV_MAX_NEW`` new tokens (a KV-only prefill of a long
    chunk) runs the reference op: the kernel's score tiles grow with the square of the step
    length and would not fit a GPU's shared memory; shorter steps run the kernel."""
    from replayssm.kernels import gdn as KG
    from replayssm.kernels import mamba2 as K2
    from replayssm.ops.gdn import naive as NG
    from replayssm.ops.mamba2 import naive as N2

    kernels_env("triton")
    kern, naive = (K2, N2) if fam == "mamba2" else (KG, NG)
    called = []
    monkeypatch.setattr(kern, "kv_verify", lambda *a, **k: called.append("kernel"))
    monkeypatch.setattr(naive, "kv_verify", lambda *a, **k: called.append("reference"))
    ops = dispatch.KernelOps(fam, backend="triton")
    for T in (1, kern.KV_MAX_NEW, kern.KV_MAX_NEW + 1, 245):
        lead = torch.zeros(2, T, 3, 4, device=DEVICE)
        ops.kv_verify(None, None, lead, lead)
    assert called == ["kernel", "kernel", "reference", "reference"]
