"""FP8 linear layer on the GPU (contract of :func:`replayssm.ops.fp8.naive.linear`).

``y = x Ŵᵀ (+ b)`` with ``Ŵ = q ⊙ S↑`` (block ``(bo, bi)``) or ``s · q`` (per-tensor).  A
launch is a :class:`GemmConfig`, chosen from the shape by :func:`config_for` (the table
:data:`CONFIGS`, keyed by the row count ``M``, and per-shape entries :data:`SHAPE_CONFIGS`;
``scripts/tune_fp8_gemm.py`` prints a new one, ``scripts/tune_fp8_gemv.py`` writes a JSON
table for :func:`use_table`):

* ``stream`` (decode, weight-only, built for the copy ceiling): program ``(row tile, column
  tile, K range)`` on a flat grid reads each ``[BLOCK_N, BLOCK_K]`` e4m3 tile once for all the
  rows of its tile; fp32 FMAs below 16 rows, ``tl.dot`` from 16; K split for ``waves``
  programs per SM, ranges added by a summing launch, fp32 atomics or the tile's last program.

* ``gemv`` (decode, weight-only): program ``(n tile, row, K range)`` streams ``[BLOCK_N,
  UNROLL·BLOCK_K]`` e4m3 tiles (K contiguous, the next one loaded while this one is used),
  widens them to fp32 in registers and accumulates ``w · s_w · x`` elementwise over its K
  range; one reduction at the end.
  Activations are not quantized: ``y = x Ŵᵀ`` in fp32, the reference's own scheme.
* ``dot`` (Triton tensor cores): tiles ``[BLOCK_M, BLOCK_N]`` walking ``K`` in tiles of
  ``BLOCK_K`` (a divisor of ``bi``: one weight scale per column and K tile).  With FP8
  activations (``act_quant``) each token's group of ``BLOCK_K`` channels is quantized
  (``s_a = amax / 448``, the dynamic per-token-group scheme of
  :func:`replayssm.ops.fp8.naive.linear_act_quant`) in a pass of its own (``prequant``) or
  inside each tile, and ``acc += (q_a · q_wᵀ) ⊙ (s_a ⊗ s_w)`` runs on FP8 tensor cores; without
  it the e4m3 tile is widened to the activation dtype (weight-only).  Tiles are ordered in
  groups of ``GROUP_M`` row tiles (L2 reuse of weight tiles).
* ``cublas``: ``torch._scaled_mm`` with block scales (1×128 activation groups from the same
  quantization pass, the checkpoint's 128×128 weight scales); block (128, 128) and ``K`` a
  multiple of 128 only (else the ``dot`` launch of the largest bucket).
  Per-tensor weights with ``K``, ``N`` multiples of 16 take ``torch._scaled_mm`` from
  :data:`PREQUANT_M` rows on (static ``input_scale`` when the checkpoint has one, else per
  token), the Triton kernels below it.

Split-K (``split_k``, or by a byte model when the grid has fewer programs than SMs) writes fp32
partial sums that one more launch adds in a fixed order (bias and cast included).  Everything depends on
shapes only (CUDA-graph safe; no host sync).  Accumulation is fp32, output in ``x``'s dtype.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops.fp8.naive import FP8, FP8_MAX, scale_grid
from ._triton import GRID_YZ_MAX, HAVE_TRITON, flat_grid, interpreting, next_pow2, persistent_programs, triton, tl

__all__ = ["linear", "k_tile", "e4m3", "GemmConfig", "CONFIGS", "SHAPE_CONFIGS", "config_for", "resolve",
           "use_table", "table_from_json"]

_HUGE = 1 << 30   # "block" extent of a per-tensor scale
#: rows from which per-tensor weights go to ``torch._scaled_mm`` (Triton below)
PREQUANT_M = 65
KERNELS = ("gemv", "stream", "dot", "cublas")
#: how a ``stream`` launch adds its K ranges: fp32 partial sums + a summing launch (``sum``),
#: ``tl.atomic_add`` into a zeroed fp32 buffer + a cast (``atomic``), or in the same launch by
#: the last program of each tile to finish (``fixup``: a counter per tile, fixed summing order)
REDUCES = ("sum", "atomic", "fixup")


def _pow2(v: int) -> bool:
    return isinstance(v, int) and v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class GemmConfig:
    """One launch of the FP8 GEMM.  ``kernel``: ``gemv`` (weight-only, a program per row),
    ``stream`` (weight-only, every row of a tile per program, split-K), ``dot`` or ``cublas``;
    ``act_quant``: FP8 activations (``dot``, ``cublas``; float32 inputs only when asked for
    explicitly); ``prequant``: ``dot`` quantizes them in a pass of its own, not per tile;
    ``block_*``: tile (powers of
    two; ``block_k`` is capped at the weight's K tile, and FP8 activations always use the full
    K tile, their group); ``unroll``: ``gemv`` K tiles per loop step; ``split_k``: K ranges
    (0: from the grid); ``group_m``: row tiles per tile group (``dot``).  ``stream`` only:
    ``block_m`` < 16 accumulates with fp32 FMAs (rows per program: ``min(block_m, M)``
    rounded up to a power of two), >= 16 with ``tl.dot``; ``reduce`` (:data:`REDUCES`) adds
    the K ranges; ``waves``: programs per SM the automatic split aims at."""

    kernel: str = "dot"
    act_quant: bool = True
    prequant: bool = True
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    unroll: int = 1
    split_k: int = 0
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    reduce: str = "sum"
    waves: int = 4

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.kernel in ("gemv", "stream") and self.act_quant:
            raise ValueError(f"the {self.kernel} kernel is weight-only: act_quant must be False")
        stream = self.kernel == "stream"
        lo_m = 1 if stream else 16
        lo_n = 1 if self.kernel == "gemv" or (stream and self.block_m < 16) else 16
        for name, lo_ in (("block_m", lo_m), ("block_n", lo_n), ("block_k", 16)):
            v = getattr(self, name)
            if not _pow2(v) or v < lo_:
                raise ValueError(f"{name} must be a power of two >= {lo_}, got {v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not _pow2(self.unroll) or self.unroll > 16:
            raise ValueError(f"unroll must be a power of two <= 16, got {self.unroll!r}")
        for name in ("group_m", "num_stages"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not isinstance(self.split_k, int) or not 0 <= self.split_k <= 64:
            raise ValueError(f"split_k must be an int in [0, 64] (0: from the grid), got {self.split_k!r}")
        if self.reduce not in REDUCES:
            raise ValueError(f"reduce must be one of {REDUCES}, got {self.reduce!r}")
        if not isinstance(self.waves, int) or not 1 <= self.waves <= 64:
            raise ValueError(f"waves must be an int in [1, 64], got {self.waves!r}")

    def name(self) -> str:
        """Compact label (tables, JSON)."""
        if self.kernel == "gemv":
            t = f"gemv n{self.block_n} k{self.block_k}x{self.unroll}"
        elif self.kernel == "stream":
            how = "fma" if self.block_m < 16 else "dot"
            t = (f"stream-{how} m{self.block_m} n{self.block_n} k{self.block_k} s{self.num_stages} "
                 f"{self.reduce}" + ("" if self.split_k else f" v{self.waves}"))
        elif self.kernel == "cublas":
            return "cublas-block"
        else:
            mode = ("fp8pre" if self.prequant else "fp8tile") if self.act_quant else "wonly"
            t = f"dot-{mode} m{self.block_m} n{self.block_n} k{self.block_k} g{self.group_m} s{self.num_stages}"
        return f"{t} w{self.num_warps}" + (f" sk{self.split_k}" if self.split_k else "")

    def to_dict(self) -> dict:
        """The fields (JSON); :meth:`from_dict` inverts it."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: dict) -> "GemmConfig":
        """A config from :meth:`to_dict`'s fields (unknown keys: ValueError)."""
        if not isinstance(d, dict):
            raise ValueError(f"a launch must be a dict of GemmConfig fields, got {type(d).__name__}")
        bad = sorted(set(d) - set(cls.__dataclass_fields__))
        if bad:
            raise ValueError(f"unknown GemmConfig fields {bad}")
        return cls(**d)


#: default launch per bucket of rows ``M``: the entry of the smallest key >= M.  The
#: per-bucket winners of ``scripts/tune_fp8_gemm.py`` on an H200 (2026-11-27; layer-weighted
#: GEMM time per step of both 4B presets), except the prefill bucket: ``cublas`` (block-scaled
#: ``torch._scaled_mm``, 1.10-1.76x bf16 at 2048 rows where K is a multiple of 128) with the
#: best measured Triton launch where it cannot run (:data:`_PREFILL_DOT`).
ANY_M = 1 << 31
CONFIGS: dict[int, GemmConfig] = {
    1: GemmConfig("dot", act_quant=False, prequant=True, block_m=16, block_n=32, num_warps=4, num_stages=4),
    16: GemmConfig("dot", act_quant=False, prequant=True, block_m=16, block_n=32, num_warps=4, num_stages=4),
    64: GemmConfig("dot", act_quant=True, prequant=True, block_m=64, block_n=64, num_warps=4, num_stages=4),
    256: GemmConfig("dot", act_quant=True, prequant=True, block_m=64, block_n=64, num_warps=4, num_stages=4),
    ANY_M: GemmConfig("cublas"),
}
#: where a ``cublas`` entry meets a K that ``_scaled_mm`` does not take (not a multiple of 512
#: with block 128): ``dot`` (the Triton FP8-activation launch), ``pad`` (K padded per call with
#: zero blocks to a multiple of 512, then ``_scaled_mm``; same scheme) or ``dequant`` (the weight
#: dequantized to the activation dtype by one pass, then ``F.linear``: the weight-only scheme)
PREFILL_FALLBACKS = ("dot", "pad", "dequant")
CUBLAS_K_FALLBACK = "dot"
#: FP8-activation launch for a bucket whose entry is the (weight-only) gemv
_ACT_DECODE = GemmConfig("dot", prequant=False, block_m=16, block_n=64, num_warps=4, num_stages=4)
#: Triton launch where a ``cublas`` entry does not apply, unless the largest bucket's is a ``dot``
_PREFILL_DOT = GemmConfig("dot", act_quant=True, prequant=True, block_m=64, block_n=128, num_warps=4, num_stages=4)


def _dot_fallback(act: bool) -> GemmConfig:
    """The ``dot`` launch for calls whose entry cannot run (a ``cublas`` entry off its shapes,
    or weight-only; a gemv beyond the grid): the largest bucket's entry when it is one."""
    big = CONFIGS[max(CONFIGS)]
    return replace(big if big.kernel == "dot" else _PREFILL_DOT, act_quant=act)


#: per-shape launches, ``(bucket, N, K) -> GemmConfig`` (``bucket``: the :data:`CONFIGS` key
#: the row count falls in); they take precedence over the bucket's entry.  Filled from a tune
#: table (:func:`use_table`).
SHAPE_CONFIGS: dict[tuple[int, int, int], GemmConfig] = {}
#: tune table read at import when present (``REPLAYSSM_FP8_TABLE`` names another file)
TABLE_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "fp8_gemm_table.json")


def bucket_of(M: int, table: dict | None = None) -> int:
    """The key of ``table`` (default :data:`CONFIGS`) whose entry serves ``M`` rows: the
    smallest key >= M, else the largest."""
    table = CONFIGS if table is None else table
    keys = sorted(table)
    return next((b for b in keys if M <= b), keys[-1])


def config_for(M: int, table: dict | None = None, N: int | None = None, K: int | None = None) -> GemmConfig:
    """The launch for ``M`` rows: the per-shape entry of ``(bucket, N, K)`` when the default
    table is used and it has one, else the table's entry for ``M`` (smallest key >= M)."""
    b = bucket_of(M, table)
    if table is None and N is not None:
        hit = SHAPE_CONFIGS.get((b, int(N), int(K)))
        if hit is not None:
            return hit
    return (CONFIGS if table is None else table)[b]


def table_from_json(obj) -> tuple[dict[int, GemmConfig], dict[tuple[int, int, int], GemmConfig]]:
    """``(buckets, shapes)`` of a tune table: ``obj`` (a dict, or the path of a JSON file) with
    ``"buckets": {"<M bound>" | "any": {GemmConfig fields}}`` and optionally ``"shapes": [{"bucket",
    "N", "K", "config": {fields}}]`` (``scripts/tune_fp8_gemv.py`` writes one).  Bad entries:
    ValueError naming them."""
    if isinstance(obj, (str, os.PathLike)):
        with open(obj) as f:
            obj = json.load(f)
    if not isinstance(obj, dict) or not isinstance(obj.get("buckets"), dict):
        raise ValueError("a tune table is a dict with a 'buckets' dict of launches")
    buckets = {}
    for k, v in obj["buckets"].items():
        key = ANY_M if str(k) == "any" else int(k)
        if key < 1:
            raise ValueError(f"bucket {k!r}: row bounds are positive")
        buckets[key] = GemmConfig.from_dict(v)
    shapes = {}
    for e in obj.get("shapes", []):
        try:
            key = (ANY_M if str(e["bucket"]) == "any" else int(e["bucket"]), int(e["N"]), int(e["K"]))
            shapes[key] = GemmConfig.from_dict(e["config"])
        except (KeyError, TypeError) as err:
            raise ValueError(f"shape entry {e!r}: needs bucket, N, K and config ({err})") from None
    return buckets, shapes


def use_table(obj, merge: bool = True) -> None:
    """Install a tune table (see :func:`table_from_json`): its buckets replace or join
    :data:`CONFIGS` (``merge=False``: replace the whole table; it must then cover any row
    count, i.e. hold an ``any`` bucket), its shapes replace :data:`SHAPE_CONFIGS`, its
    ``"cublas_k_fallback"`` (optional) sets :data:`CUBLAS_K_FALLBACK`."""
    global CUBLAS_K_FALLBACK
    if isinstance(obj, (str, os.PathLike)):
        with open(obj) as f:
            obj = json.load(f)
    buckets, shapes = table_from_json(obj)
    fb = obj.get("cublas_k_fallback", CUBLAS_K_FALLBACK)
    if fb not in PREFILL_FALLBACKS:
        raise ValueError(f"cublas_k_fallback must be one of {PREFILL_FALLBACKS}, got {fb!r}")
    if not merge and ANY_M not in buckets:
        raise ValueError("a replacing table needs an 'any' bucket (rows past every bound)")
    if not buckets:
        raise ValueError("a tune table needs at least one bucket")
    if not merge:
        CONFIGS.clear()
    CONFIGS.update(buckets)
    SHAPE_CONFIGS.clear()
    SHAPE_CONFIGS.update(shapes)
    CUBLAS_K_FALLBACK = fb


def k_tile(block) -> int | None:
    """``BLOCK_K`` for a weight of ``block``: the largest power of two <= 128 dividing ``bi``
    (per-tensor: 128); None when that is below 16 (the call then runs the reference)."""
    if block is None:
        return 128
    bi = int(block[1])
    t = bi & -bi
    t = min(t, 128)
    return t if t >= 16 else None


#: which calls the kernel takes (others run the reference: kernels.dispatch)
SUPPORTS = {"linear": lambda x, weight, scale, bias=None, *, block=None, **kw:
            k_tile(block) is not None and x.dtype != torch.float64}

if HAVE_TRITON:

    @triton.jit
    def e4m3(q, EXACT: tl.constexpr):
        """``q`` (fp32, ``|q| <= 448``) rounded to e4m3, to nearest even.  ``EXACT`` (under the
        CPU interpreter, whose fp32 -> e4m3 cast misplaces values that round up to the next
        power of two) rounds on the e4m3 grid in fp32 first, so the cast is exact."""
        if EXACT:
            e = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(q), 1e-30))), -6.0)
            step = tl.exp2(e - 3.0)
            y = q / step                                   # exact: a power-of-two step
            r = tl.floor(y + 0.5)
            odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
            r = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)  # ties to even
            q = r * step
        return q.to(tl.float8e4nv)

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, G, sxm, sqm, ssm, ssg, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
                          EXACT: tl.constexpr):
        """Row ``m``, groups ``g`` of this program (``GROUPS`` of them): ``s = amax(|x_g|) / 448``
        (stored at ``m·ssm + g·ssg``), ``q = x / s`` in e4m3 (stored as bytes, rows ``sqm`` apart)."""
        m = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        kk = g[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
        km = kk < K
        x = tl.load(x_ptr + m * sxm + kk, mask=km, other=0.0).to(tl.float32)
        sa = tl.maximum(tl.max(tl.abs(x), 1), 1e-30) / 448.0
        q = e4m3(x / sa[:, None], EXACT).to(tl.uint8, bitcast=True)
        tl.store(q_ptr + m * sqm + kk, q, mask=km)
        tl.store(s_ptr + m * ssm + g * ssg, sa, mask=g < G)

    @triton.jit(do_not_specialize=["M"])       # the batch changes every step
    def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, sxm, BO, BI, NBI, KSPLIT,
                     HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, UNROLL: tl.constexpr):
        """Weight-only ``y[m, n] = Σ_k x[m, k] q[n, k] S↑[n, k]`` for this program's column tile
        and K range, in steps of ``UNROLL`` K tiles ``[BLOCK_N, UNROLL, BLOCK_K]`` (one weight
        scale each): elementwise fp32 accumulation, reduced once at the end.  The next step's
        weight tile is loaded before this step's multiply (one step of prefetch)."""
        pid_n = tl.program_id(0)
        m = tl.program_id(1).to(tl.int64)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = rn < N
        srow = (rn // BO) * NBI
        ru = tl.arange(0, UNROLL)
        kt = ru[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]          # [UNROLL, BLOCK_K] of a step
        wptr = w_ptr + rn.to(tl.int64)[:, None, None] * K + kt[None, :, :]
        acc = tl.zeros([BLOCK_N, UNROLL, BLOCK_K], tl.float32)
        k_lo = pid_k * KSPLIT
        k_hi = tl.minimum(K, k_lo + KSPLIT)
        STEP: tl.constexpr = BLOCK_K * UNROLL
        wn = tl.load(wptr + k_lo, mask=nm[:, None, None] & (k_lo + kt < k_hi)[None, :, :], other=0.0)
        for k0 in range(k_lo, k_hi, STEP):
            w = wn
            wn = tl.load(wptr + (k0 + STEP), mask=nm[:, None, None] & (k0 + STEP + kt < k_hi)[None, :, :], other=0.0)
            xv = tl.load(x_ptr + m * sxm + k0 + kt, mask=k0 + kt < k_hi, other=0.0).to(tl.float32)
            ws = tl.load(s_ptr + srow[:, None] + tl.minimum((k0 + ru * BLOCK_K) // BI, NBI - 1)[None, :],
                         mask=nm[:, None], other=0.0)                      # past K: w is 0
            acc += w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * (xv[None, :, :] * ws[:, :, None])
        y = tl.sum(tl.sum(acc, 2), 1)
        if SPLIT:
            tl.store(y_ptr + (pid_k.to(tl.int64) * M + m) * N + rn, y, mask=nm)
        else:
            if HAS_BIAS:
                y += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)
            tl.store(y_ptr + m * N + rn, y.to(y_ptr.dtype.element_ty), mask=nm)

    @triton.jit(do_not_specialize=["M"])       # the batch changes every step
    def _dot_kernel(
        a_ptr, w_ptr, s_ptr, b_ptr, y_ptr, as_ptr, M, N, K, sam, BO, BI, NBI, KSPLIT, G,
        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        PREC: tl.constexpr, EXACT: tl.constexpr,
    ):
        """``MODE`` 0: weight-only (e4m3 tile widened to ``a``'s dtype); 1: activations
        quantized per token and K tile here; 2: activations already e4m3 bytes with scales
        ``as [M, G]``."""
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)          # split-K: this program's K range
        grid_m = tl.cdiv(M, BLOCK_M)
        grid_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * grid_n
        first_m = (pid // width) * GROUP_M
        gsize = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % gsize
        pid_n = (pid % width) // gsize
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mm = rm < M
        nm = rn < N
        srow = (rn // BO) * NBI
        arow = a_ptr + rm.to(tl.int64)[:, None] * sam
        wcol = w_ptr + rn.to(tl.int64)[None, :] * K
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_lo = pid_k * KSPLIT
        for k0 in range(k_lo, tl.minimum(K, k_lo + KSPLIT), BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < K
            a = tl.load(arow + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            w = tl.load(wcol + kk[:, None], mask=km[:, None] & nm[None, :], other=0.0).to(tl.float8e4nv, bitcast=True)
            ws = tl.load(s_ptr + srow + k0 // BI, mask=nm, other=0.0)
            if MODE == 2:
                sa = tl.load(as_ptr + rm.to(tl.int64) * G + k0 // BLOCK_K, mask=mm, other=0.0)
                acc += tl.dot(a.to(tl.float8e4nv, bitcast=True), w) * (sa[:, None] * ws[None, :])
            elif MODE == 1:
                af = a.to(tl.float32)
                sa = tl.maximum(tl.max(tl.abs(af), 1), 1e-30) / 448.0
                acc += tl.dot(e4m3(af / sa[:, None], EXACT), w) * (sa[:, None] * ws[None, :])
            elif EXACT:   # the CPU interpreter's 16-bit dot is not a float dot: widen both
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee") * ws[None, :]
            else:
                acc += tl.dot(a, w.to(tl.float32).to(a.dtype), input_precision=PREC) * ws[None, :]
        if SPLIT:
            y_ptr += pid_k.to(tl.int64) * M * N
        elif HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mm[:, None] & nm[None, :])

    @triton.jit(do_not_specialize=["M", "PS"])       # the batch changes every step
    def _stream_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, c_ptr, M, N, K, sxm, BO, BI, NBI, KSPLIT, S, PS,
                       HAS_BIAS: tl.constexpr, REDUCE: tl.constexpr, DOT: tl.constexpr, UNIFORM: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PREC: tl.constexpr, EXACT: tl.constexpr):
        """Weight-only ``y[m, n] = Σ_k x[m, k] q[n, k] S↑[n, k]`` for this program's rows
        ``[BLOCK_M]`` (every row of the tile reads the weight tile once), columns ``[BLOCK_N]``
        and K range (``KSPLIT`` wide), in K tiles ``[BLOCK_N, BLOCK_K]`` of e4m3 bytes (K
        contiguous).  ``DOT``: ``acc += (x q_tileᵀ) · s`` on tensor cores; else fp32 FMAs
        ``acc[m, n, k] += x[m, k] s q[n, k]`` reduced over k once at the end (the next weight
        tile is loaded before this one is used).  ``UNIFORM``: the tile's rows share one block
        row, so the scale is one number per K tile, applied to ``x`` (FMA) or the tile's sum.
        Flat grid, row tile fastest, then column tile, then K range.  ``REDUCE`` 0: one K range,
        ``y`` stored (bias, cast); 1: fp32 partial sums ``p [S, M, N]`` (``PS = M·N`` apart); 2: ``atomic_add`` into
        fp32 ``y`` (bias from the first range); 3: partial sums, then the last program of the
        tile to finish (counter ``c``) adds them in order, stores ``y`` and resets ``c``."""
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BLOCK_M)
        grid_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid % grid_m
        rest = pid // grid_m
        pid_n = rest % grid_n
        pid_k = rest // grid_n
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mm = rm < M
        nm = rn < N
        xrow = x_ptr + rm.to(tl.int64)[:, None] * sxm
        wrow = w_ptr + rn.to(tl.int64)[:, None] * K
        srow = (rn // BO) * NBI
        s0 = ((pid_n * BLOCK_N) // BO) * NBI
        k_lo = pid_k * KSPLIT
        k_hi = tl.minimum(K, k_lo + KSPLIT)
        if DOT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                kk = k0 + rk
                km = kk < k_hi
                a = tl.load(xrow + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
                w = tl.load(wrow + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
                w = w.to(tl.float8e4nv, bitcast=True)
                if EXACT:   # the CPU interpreter's 16-bit dot is not a float dot: widen both
                    part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
                else:
                    part = tl.dot(a, tl.trans(w.to(tl.float32).to(a.dtype)), input_precision=PREC)
                if UNIFORM:
                    acc += part * tl.load(s_ptr + s0 + k0 // BI)
                else:
                    acc += part * tl.load(s_ptr + srow + k0 // BI, mask=nm, other=0.0)[None, :]
            y = acc
        else:   # everything 3D [rows, columns, K] (one layout: the weight load's, 16 B per thread)
            w3 = w_ptr + rn.to(tl.int64)[None, :, None] * K + rk[None, None, :]
            x3 = x_ptr + rm.to(tl.int64)[:, None, None] * sxm + rk[None, None, :]
            nm3 = nm[None, :, None]
            mm3 = mm[:, None, None]
            acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
            wn = tl.load(w3 + k_lo, mask=nm3 & (k_lo + rk < k_hi)[None, None, :], other=0.0)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                w = wn
                wn = tl.load(w3 + (k0 + BLOCK_K), mask=nm3 & (k0 + BLOCK_K + rk < k_hi)[None, None, :], other=0.0)
                xv = tl.load(x3 + k0, mask=mm3 & (k0 + rk < k_hi)[None, None, :], other=0.0).to(tl.float32)
                wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                if UNIFORM:
                    xv = xv * tl.load(s_ptr + s0 + k0 // BI)
                else:
                    wf = wf * tl.load(s_ptr + srow + k0 // BI, mask=nm, other=0.0)[None, :, None]
                acc3 += xv * wf
            y = tl.sum(acc3, 2)
        off = rm.to(tl.int64)[:, None] * N + rn[None, :]
        om = mm[:, None] & nm[None, :]
        if REDUCE == 0:
            if HAS_BIAS:
                y += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=om)
        elif REDUCE == 2:
            if HAS_BIAS:
                nb = tl.where(pid_k == 0, N, 0)                  # the first K range adds it
                y += tl.load(b_ptr + rn, mask=rn < nb, other=0.0).to(tl.float32)[None, :]
            tl.atomic_add(y_ptr + off, y, mask=om)
        else:
            tl.store(p_ptr + pid_k.to(tl.int64) * PS + off, y, mask=om)
            if REDUCE == 3:
                tile = pid_n * grid_m + pid_m
                tl.debug_barrier()              # every thread's partial stored before the release
                done = tl.atomic_add(c_ptr + tile, 1, sem="acq_rel", scope="gpu")
                if done == S - 1:                                      # the last one: acquire, then sum
                    tot = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                    pr = p_ptr + off
                    for _ in range(0, S):
                        tot += tl.load(pr, mask=om, other=0.0, cache_modifier=".cg")
                        pr += PS
                    if HAS_BIAS:
                        tot += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
                    tl.store(y_ptr + off, tot.to(y_ptr.dtype.element_ty), mask=om)
                    tl.atomic_xchg(c_ptr + tile, 0)

    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, y_ptr, N, K, BO, BI, NBI, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """``y = q ⊙ S↑`` on this program's tile ``[BLOCK_N, BLOCK_K]`` (fp32 product, cast)."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        m = (rn < N)[:, None] & (rk < K)[None, :]
        off = rn.to(tl.int64)[:, None] * K + rk[None, :]
        w = tl.load(w_ptr + off, mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sc = tl.load(s_ptr + (rn // BO)[:, None] * NBI + (rk // BI)[None, :], mask=m, other=0.0)
        tl.store(y_ptr + off, (w * sc).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["MN"])
    def _splitk_sum_kernel(p_ptr, b_ptr, y_ptr, S, MN, N, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        """``y = Σ_s p[s] (+ b)`` over the ``S`` partial sums, in order (fixed rounding)."""
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        om = o < MN
        acc = tl.zeros([BLOCK], tl.float32)
        for _ in range(0, S):
            acc += tl.load(p_ptr + o, mask=om, other=0.0)
            p_ptr += MN
        if HAS_BIAS:
            acc += tl.load(b_ptr + o % N, mask=om, other=0.0).to(tl.float32)
        tl.store(y_ptr + o, acc.to(y_ptr.dtype.element_ty), mask=om)


def _auto_split(device, programs: int, k_tiles: int, M: int, N: int, K: int) -> int:
    """K splits for a launch of ``programs`` tiles, by a byte model of the memory-bound GEMM:
    ``S`` minimizing ``(N·K + 8·S·M·N + [S > 1]·2 MB) / min(1, S·programs / SMs)`` — the
    weight plus the fp32 partial sums (written and read) and the summing launch, over the
    share of SMs busy; each split at least 4 K tiles long, at most 16."""
    sms = persistent_programs(device, 1 << 30, 1) if device.type == "cuda" else 1
    best, best_cost = 1, None
    for S in range(1, max(1, min(16, k_tiles // 4)) + 1):
        cost = (N * K + 8 * S * M * N + (2e6 if S > 1 else 0)) / min(1.0, S * programs / sms)
        if best_cost is None or cost < best_cost:
            best, best_cost = S, cost
    return best


#: tile counters per (device, stream) of the ``fixup`` reduction; launches with more tiles
#: than this reduce with a summing launch instead
COUNTER_SLOTS = 1 << 16
_COUNTERS: dict = {}


def _counters(device) -> Tensor:
    """Zeroed int32 tile counters of the ``fixup`` reduction (every launch leaves them zero):
    one fixed buffer per device and stream (never reallocated, so captured graphs keep theirs)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def stream_split(device, tiles: int, k_tiles: int, waves: int) -> int:
    """K ranges of a ``stream`` launch of ``tiles`` row × column tiles: enough that the grid
    holds ``waves`` programs per SM, each range at least two K tiles (one when K has one), at
    most 64 ranges."""
    sms = persistent_programs(device, 1 << 30, 1) if device.type == "cuda" else 1
    want = -(-waves * sms // max(1, tiles))
    return max(1, min(want, max(1, k_tiles // 2), 64))


def stream_plan(M: int, N: int, K: int, cfg: GemmConfig, bk_w: int, device) -> dict:
    """The ``stream`` launch's shape decisions (also for the tune script's byte counts): rows
    per program ``BM``, ``BN``, ``BK``, K ranges ``S`` of ``KS`` columns, the reduction (0 none,
    1 sum, 2 atomic, 3 fixup) and the tile count."""
    dot = cfg.block_m >= 16
    BM = min(cfg.block_m, next_pow2(M))
    BM = max(16, BM) if dot else BM
    BN, BK = cfg.block_n, min(cfg.block_k, bk_w)
    tiles = -(-M // BM) * -(-N // BN)
    k_tiles = -(-K // BK)
    S = min(cfg.split_k or stream_split(device, tiles, k_tiles, cfg.waves), k_tiles)
    KS = -(-k_tiles // S) * BK
    S = -(-K // KS)
    red = 0 if S == 1 else REDUCES.index(cfg.reduce) + 1
    if red == 3 and tiles > COUNTER_SLOTS:
        red = 1
    return dict(dot=dot, BM=BM, BN=BN, BK=BK, S=S, KS=KS, reduce=red, tiles=tiles)


def _stream(x2: Tensor, wq: Tensor, s32: Tensor, bias, cfg: GemmConfig, bk_w: int, BO: int, BI: int, NBI: int,
            out_dtype) -> Tensor:
    """Launch :func:`_stream_kernel` (and the summing launch or the cast its reduction needs)."""
    M, K = x2.shape
    N = wq.shape[0]
    pl = stream_plan(M, N, K, cfg, bk_w, x2.device)
    S, red = pl["S"], pl["reduce"]
    dev = x2.device
    if red == 2:
        y = torch.zeros(M, N, dtype=torch.float32, device=dev)
    else:
        y = torch.empty(M, N, dtype=out_dtype, device=dev) if red != 1 else None
    p = torch.empty(S, M, N, dtype=torch.float32, device=dev) if red in (1, 3) else None
    c = _counters(dev) if red == 3 else None
    dummy = y if y is not None else p
    grid = flat_grid(pl["tiles"] * S)
    _stream_kernel[grid](
        x2, wq, s32, bias if bias is not None else dummy, dummy, p if p is not None else dummy,
        c if c is not None else dummy, M, N, K, x2.stride(0), BO, BI, NBI, pl["KS"], S, M * N,
        HAS_BIAS=bias is not None, REDUCE=red, DOT=pl["dot"], UNIFORM=BO % pl["BN"] == 0,
        BLOCK_M=pl["BM"], BLOCK_N=pl["BN"], BLOCK_K=pl["BK"],
        PREC="ieee" if out_dtype == torch.float32 else "tf32", EXACT=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if red == 1:
        y = torch.empty(M, N, dtype=out_dtype, device=dev)
        BLOCK = 1024
        _splitk_sum_kernel[(-(-(M * N) // BLOCK),)](p, bias if bias is not None else y, y, S, M * N, N,
                                                     HAS_BIAS=bias is not None, BLOCK=BLOCK, num_warps=4)
    elif red == 2 and out_dtype != torch.float32:
        y = y.to(out_dtype)
    return y


def _block_mm_ok(x2: Tensor, weight: Tensor, block, any_k: bool = False) -> bool:
    """``torch._scaled_mm`` with 1×128 activation and 128×128 weight scales applies: whole K
    blocks, in a multiple of four (on the H200 a K of 98 blocks, Nemotron-H-4B's MLP down
    projection, gave wrong sums while 16, 32, 60 and 40 blocks were exact); other shapes take
    the Triton ``dot`` kernel (or :data:`CUBLAS_K_FALLBACK`; ``any_k``: any K, to be padded)."""
    return (block is not None and tuple(block) == (128, 128) and x2.is_cuda
            and x2.dtype in (torch.bfloat16, torch.float16) and weight.shape[0] % 16 == 0
            and (any_k or weight.shape[1] % 512 == 0) and hasattr(torch, "_scaled_mm"))


def _scaled_mm_ok(x: Tensor, weight: Tensor, block) -> bool:
    return (block is None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0 and hasattr(torch, "_scaled_mm"))


def _scaled_mm(x2: Tensor, weight: Tensor, scale: Tensor, bias, input_scale) -> Tensor:
    """Per-tensor FP8 GEMM through ``torch._scaled_mm`` (static or per-token activation scales)."""
    xf = x2.float()
    if input_scale is not None:
        sa = input_scale.float().reshape(())
        sb = scale.float().reshape(())
    else:
        sa = (xf.abs().amax(-1, keepdim=True).clamp_min(1e-30) / FP8_MAX)
        sb = scale.float().reshape(1, 1).expand(1, weight.shape[0]).contiguous()
    q = (xf / sa).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = x2.dtype if input_scale is not None else torch.bfloat16   # row-wise scales: bf16 output only
    y = torch._scaled_mm(q, weight.t(), scale_a=sa, scale_b=sb, out_dtype=out).to(x2.dtype)
    return y if bias is None else y + bias


def _quantize_rows(x2: Tensor, BK: int, scale_rows_major: bool = True, rows: int | None = None,
                   cols: int | None = None) -> tuple[Tensor, Tensor]:
    """``(q [R, C] bytes, s_a [R, ceil(C/BK)])`` of the per-token-group scheme (groups of ``BK``)
    for ``R = rows`` (default ``M``; rows past ``M`` are zeros with scale 1) and ``C = cols``
    (default ``K``; columns past ``K`` are zeros, whole groups past it have scale 1);
    ``scale_rows_major=False`` stores ``s_a`` as the transpose of a ``[G, R]`` buffer."""
    M, K = x2.shape
    R = M if rows is None else rows
    C = K if cols is None else cols
    G, GC = -(-K // BK), -(-C // BK)
    q = torch.empty(R, C, dtype=torch.uint8, device=x2.device)
    if scale_rows_major:
        s, ssm, ssg = torch.empty(R, GC, dtype=torch.float32, device=x2.device), GC, 1
    else:
        s, ssm, ssg = torch.empty(GC, R, dtype=torch.float32, device=x2.device).t(), 1, R
    GR = min(4, next_pow2(G))
    _act_quant_kernel[(M, -(-G // GR))](x2, q, s, K, G, x2.stride(0), C, ssm, ssg, BLOCK_K=BK, GROUPS=GR,
                                        EXACT=interpreting(), num_warps=4 if GR * BK >= 512 else 2)
    if R > M:
        q[M:].zero_()
        s[M:].fill_(1.0)
    if C > K:
        q[:, K:].zero_()
        s[:, G:].fill_(1.0)
    return q, s


def _cublas_block(x2: Tensor, weight: Tensor, scale: Tensor, bias, pad: bool = False) -> Tensor:
    """Block-scaled ``torch._scaled_mm``: 1×128 activation groups (outer-dim-major scales;
    rows padded to a multiple of 16 with zeros), the 128×128 weight scales transposed; bf16
    output.  ``pad``: K first padded to a multiple of 512 with zero columns (weight bytes and
    activations; the added scale blocks are 1), a per-call copy of the weight; the sums are
    unchanged."""
    M, K = x2.shape
    Kp = -(-K // 512) * 512 if pad else K
    weight, scale = _pad_k(weight, scale, Kp, 128)
    q, sa = _quantize_rows(x2, 128, scale_rows_major=False, rows=-(-M // 16) * 16, cols=Kp)
    y = torch._scaled_mm(q.view(FP8), weight.t(), scale_a=sa, scale_b=scale.float().t(),
                         out_dtype=torch.bfloat16)[:M]
    y = y if bias is None else y + bias
    return y.to(x2.dtype)


def _pad_k(weight: Tensor, scale: Tensor, Kp: int, bi: int) -> tuple[Tensor, Tensor]:
    """``(q [N, Kp], S [., Kp / bi])``: the weight's K padded with zero bytes, its scales with
    ones for the added column blocks (``Kp`` a multiple of ``bi``; unchanged when ``Kp = K``)."""
    K = weight.shape[1]
    if Kp == K:
        return weight, scale
    return (F.pad(weight.view(torch.uint8), (0, Kp - K)).view(weight.dtype),
            F.pad(scale.float(), (0, Kp // bi - scale.shape[1]), value=1.0))


def dequantize(weight: Tensor, scale: Tensor, block, dtype: torch.dtype) -> Tensor:
    """Kernel form of :func:`replayssm.ops.fp8.naive.dequantize_block` (``block=None``:
    ``dequantize_tensor``): ``q ⊙ S↑ [N, K]`` in ``dtype`` (the fp32 product, then cast)."""
    N, K = weight.shape
    BO, BI = (_HUGE, _HUGE) if block is None else (int(block[0]), int(block[1]))
    NBI = 1 if block is None else -(-K // BI)
    s32 = scale.float().contiguous()
    y = torch.empty(N, K, dtype=dtype, device=weight.device)
    wq = weight.view(torch.uint8)   # bytes, bitcast in the kernel (an fp8 load with `other=0` failed to compile)
    BN, BK = 32, 128
    _dequant_kernel[(-(-N // BN), -(-K // BK))](wq, s32, y, N, K, BO, BI, NBI, BLOCK_N=BN, BLOCK_K=BK, num_warps=4)
    return y


def _prefill_fallback(x2: Tensor, weight: Tensor, scale: Tensor, bias, block) -> Tensor | None:
    """A ``cublas`` call that ``_scaled_mm`` cannot take as it is, by :data:`CUBLAS_K_FALLBACK`
    (None: the Triton ``dot`` launch)."""
    how = CUBLAS_K_FALLBACK
    if how not in PREFILL_FALLBACKS:
        raise ValueError(f"CUBLAS_K_FALLBACK must be one of {PREFILL_FALLBACKS}, got {how!r}")
    if how == "pad" and _block_mm_ok(x2, weight, block, any_k=True):
        return _cublas_block(x2, weight, scale, bias, pad=True)
    if how == "dequant":
        return F.linear(x2, dequantize(weight, scale, block, x2.dtype), bias)
    return None


def resolve(M: int, dtype: torch.dtype, act_quant: bool | None = None, config: GemmConfig | None = None,
            N: int | None = None, K: int | None = None) -> GemmConfig:
    """The launch for ``M`` rows of ``dtype`` (weight ``[N, K]``: per-shape entries): ``config``
    (default :func:`config_for`), with ``act_quant`` enforced (None: the config's; the default
    table's never for float32 inputs)."""
    cfg = config or config_for(M, N=N, K=K)
    if act_quant is not None:
        act = bool(act_quant)
    else:
        act = cfg.act_quant and (config is not None or dtype not in (torch.float32, torch.float64))
    if act and cfg.kernel in ("gemv", "stream"):
        cfg = _ACT_DECODE
    if not act and cfg.kernel == "cublas":
        cfg = _dot_fallback(False)
    if cfg.kernel == "dot" and cfg.act_quant != act:
        cfg = replace(cfg, act_quant=act)
    return cfg


def linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None, *, block=None,
           input_scale: Tensor | None = None, act_quant: bool | None = None, config: GemmConfig | None = None,
           block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
           split_k: int | None = None) -> Tensor:
    """Kernel form of :func:`replayssm.ops.fp8.naive.linear` (same arguments and result up to
    rounding).  Kernel-only keywords: ``config`` (a :class:`GemmConfig`; default from the
    shape), ``act_quant`` (True: FP8 activations, per-token groups of the K tile; False:
    weight-only; None: the config's), and overrides of the config's ``block_m``, ``block_n``,
    ``num_warps``, ``split_k`` (K ranges summed in fp32 afterwards, in a fixed order)."""
    if weight.dtype != FP8 or weight.dim() != 2:
        raise ValueError(f"weight must be float8_e4m3fn [out, in], got {weight.dtype} {tuple(weight.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features, weight takes {K}")
    want = () if block is None else scale_grid(weight.shape, block)
    if tuple(scale.shape) != tuple(want):
        raise ValueError(f"scale has shape {tuple(scale.shape)}, expected {want} (block {block})")
    BKW = k_tile(block)
    if BKW is None:
        raise ValueError(f"block {block}: the kernel needs a column block divisible by 16")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    explicit = config is not None or block_m is not None
    cfg = resolve(M, x.dtype, act_quant, config, N, K)
    over = {k: v for k, v in (("block_m", block_m), ("block_n", block_n), ("num_warps", num_warps),
                              ("split_k", split_k)) if v is not None}
    if "block_m" in over:
        over["block_m"] = max(16, next_pow2(over["block_m"]))
    if "block_m" in over and cfg.kernel == "stream":
        over["block_m"] = next_pow2(block_m)
    if "block_n" in over:
        fma = cfg.kernel == "gemv" or (cfg.kernel == "stream" and over.get("block_m", cfg.block_m) < 16)
        over["block_n"] = max(1 if fma else 16, next_pow2(over["block_n"]))
    cfg = replace(cfg, **over) if over else cfg
    if cfg.act_quant and _scaled_mm_ok(x2, weight, block) and (cfg.kernel == "cublas" or (M >= PREQUANT_M and not explicit)):
        return _scaled_mm(x2, weight, scale, bias, input_scale).reshape(*lead, N)
    if M == 0:
        return torch.empty(*lead, N, dtype=x.dtype, device=x.device)
    if cfg.kernel == "cublas":
        if _block_mm_ok(x2, weight, block):
            return _cublas_block(x2, weight, scale, bias).reshape(*lead, N)
        y = _prefill_fallback(x2, weight, scale, bias, block)
        if y is not None:
            return y.reshape(*lead, N)
        cfg = _dot_fallback(True)
    if cfg.kernel == "gemv" and M > GRID_YZ_MAX:
        cfg = _dot_fallback(False)
    BO, BI = (_HUGE, _HUGE) if block is None else (int(block[0]), int(block[1]))
    NBI = 1 if block is None else want[1]
    s32 = scale if scale.dtype == torch.float32 and scale.is_contiguous() else scale.float().contiguous()
    # e4m3 operands go in as float8 pointers (tensor cores read them from shared memory as
    # they are); the CPU interpreter has no float8 arrays: bytes there, bit-cast in the kernel
    wq = weight.view(torch.uint8) if interpreting() else weight
    if cfg.kernel == "stream":
        return _stream(x2, wq, s32, bias, cfg, BKW, BO, BI, NBI, x.dtype).reshape(*lead, N)
    if cfg.kernel == "gemv":
        BK = min(cfg.block_k, BKW)
        step = BK * cfg.unroll
        BN = cfg.block_n
        programs = -(-N // BN) * M
        S = cfg.split_k or _auto_split(x.device, programs, -(-K // BK), M, N, K)
        KS = -(-(-(-K // step)) // S) * step
        S = -(-K // KS)
        y = _out(M, N, S, x)
        _gemv_kernel[(-(-N // BN), M, S)](
            x2, wq, s32, bias if bias is not None else y, y, M, N, K, x2.stride(0),
            BO, BI, NBI, KS, HAS_BIAS=bias is not None, SPLIT=S > 1, BLOCK_N=BN, BLOCK_K=BK,
            UNROLL=cfg.unroll, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        BK = BKW if cfg.act_quant else min(cfg.block_k, BKW)   # FP8 activations: groups of the K tile
        BM, BN = cfg.block_m, cfg.block_n
        grid_mn = -(-M // BM) * -(-N // BN)
        S = cfg.split_k or _auto_split(x.device, grid_mn, -(-K // BK), M, N, K)
        KS = -(-(-(-K // BK)) // S) * BK               # K per split, whole tiles
        S = -(-K // KS)
        y = _out(M, N, S, x)
        G = -(-K // BK)
        mode = 0 if not cfg.act_quant else (2 if cfg.prequant else 1)
        a, xs, sa = x2, y, x2.stride(0)
        if mode == 2:
            a, xs = _quantize_rows(x2, BK)
            a, sa = (a if interpreting() else a.view(FP8)), K
        _dot_kernel[(grid_mn, S)](
            a, wq, s32, bias if bias is not None else y, y, xs,
            M, N, K, sa, BO, BI, NBI, KS, G, HAS_BIAS=bias is not None, SPLIT=S > 1, MODE=mode,
            BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.group_m,
            PREC="ieee" if x.dtype == torch.float32 else "tf32", EXACT=interpreting(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if S > 1:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
        BLOCK = 1024
        _splitk_sum_kernel[(-(-(M * N) // BLOCK),)](y, bias if bias is not None else out, out, S, M * N, N,
                                                     HAS_BIAS=bias is not None, BLOCK=BLOCK, num_warps=4)
        y = out
    return y.reshape(*lead, N)


def _out(M: int, N: int, S: int, x: Tensor) -> Tensor:
    """The kernel's output: ``y [M, N]`` in ``x``'s dtype, or fp32 partial sums ``[S, M, N]``."""
    if S == 1:
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    return torch.empty(S, M, N, dtype=torch.float32, device=x.device)


_TABLE = os.environ.get("REPLAYSSM_FP8_TABLE") or TABLE_FILE
if os.path.exists(_TABLE):
    use_table(_TABLE)
