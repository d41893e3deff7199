"""Mamba-2 mixer (HF ``Mamba2Mixer`` / ``NemotronHMamba2Mixer`` checkpoints).

``[z | xBC | dt] = in_proj(h)``; ``xBC = silu(causal_conv(xBC))``; ``x, B, C = split(xBC)``;
``Δ = clamp(softplus(dt + dt_bias), *time_step_limit)`` (fp32+); ``A = -exp(A_log)``;
``y = SSM(x, Δ, A, B, C) + D·x`` (head ``h`` reads group ``h // (H // G)`` of B and C);
``out = out_proj(GatedRMSNorm(y, z))`` with ``y · silu(z)`` normalised over groups of
``norm_group_size`` channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache.buffers import Mamba2Buffers
from ..cache.paged import Mamba2PagedBuffers
from ..cache.prefix import Mamba2StoredEntries
from ..kernels.dispatch import ops_for
from .context import StepContext
from .derived import derived, fused_gates
from .mlp import Linear, _param
from ..runtime import compute_dtype
from .norms import GatedRMSNorm
from .ssm_base import SSMLayer


class Mamba2Mixer(SSMLayer):
    family = "mamba2"

    def __init__(self, hidden: int, num_heads: int, head_dim: int, state_size: int, n_groups: int,
                 conv_kernel: int, *, norm_group_size: int, eps: float, use_bias: bool = False,
                 use_conv_bias: bool = True, time_step_limit=(0.0, float("inf")), chunk_size: int = 64,
                 layer_id: int = 0):
        super().__init__()
        self.H, self.d, self.n, self.G = num_heads, head_dim, state_size, n_groups
        self.inter = num_heads * head_dim
        self.conv_dim = self.inter + 2 * n_groups * state_size
        self.conv_kernel, self.layer_id, self.chunk_size = conv_kernel, layer_id, chunk_size
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.in_proj = Linear(hidden, self.inter + self.conv_dim + num_heads, use_bias)
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(self.conv_dim, 1, conv_kernel)
        self.conv1d.bias = _param(self.conv_dim) if use_conv_bias else None
        self.dt_bias = _param(num_heads)
        self.A_log = _param(num_heads)
        self.D = _param(num_heads)
        self.norm = GatedRMSNorm(self.inter, eps, group_size=norm_group_size, gate_first=True)
        self.out_proj = Linear(self.inter, hidden, use_bias)

    # ---- family hooks (forms call these) -------------------------------------------------
    def _A(self, dtype) -> Tensor:
        """``A = -exp(A_log)`` in ``dtype`` ``[H]`` (cached, see :mod:`.derived`)."""
        if not fused_gates():
            return -torch.exp(self.A_log.to(dtype))
        return derived(self, ("A", dtype), (self.A_log,), lambda: -torch.exp(self.A_log.to(dtype)))

    def _cast(self, name: str, dtype) -> Tensor:
        """Parameter ``name`` in ``dtype`` (cached; the parameter itself when it has it)."""
        p = getattr(self, name)
        if p.dtype == dtype or not fused_gates():
            return p.to(dtype)
        return derived(self, (name, dtype), (p,), lambda: p.to(dtype))

    def op(self, name: str, *prefix, a: dict, t0: bool = False, packed: bool = False, **kw):
        x, dt, B, C = self._args(a, ("x", "dt", "B", "C"), t0, packed)
        return getattr(self.ops(), name)(*prefix, x, dt, self._A(dt.dtype), B, C, self._cast("D", dt.dtype), **kw)

    def mask_padding(self, a: dict, valid: Tensor) -> dict:
        a = dict(a)
        a["dt"] = torch.where(valid[..., None], a["dt"], torch.zeros_like(a["dt"]))
        return a

    def rebuild_state(self, buf, plan):
        return self.ops().rebuild_state(buf, plan, self._A(compute_dtype(buf.state.dtype)))

    def alloc_ring(self, num_slots: int, capacity: int, dtype, device, state_dtype=None) -> Mamba2Buffers:
        sdt = state_dtype or compute_dtype(dtype)
        return Mamba2Buffers.allocate(num_slots, capacity, self.H, self.d, self.n, self.G, dtype=dtype,
                                      state_dtype=sdt, decay_dtype=compute_dtype(dtype, sdt), device=device)

    def alloc_pages(self, num_blocks: int, block_size: int, dtype, device) -> Mamba2PagedBuffers:
        return Mamba2PagedBuffers.allocate(num_blocks, block_size, self.H, self.d, self.n, self.G, dtype=dtype,
                                           state_dtype=compute_dtype(dtype), device=device)

    def kv_to_state(self, store: dict, pplan, slots: Tensor) -> None:
        buf = store["buf"]
        self.ops().kv_to_state(store["kv"], pplan, buf, slots, self._A(compute_dtype(buf.state.dtype)))

    def state_shape(self) -> tuple[int, ...]:
        return (self.H, self.d, self.n)

    def prefill_entries(self, a: dict, out: tuple) -> list[Tensor]:
        return [a["x"][0], a["B"][0], a["dt"][0]]

    # ---- prefix store: Δ stored, x and B rebuilt from the conv inputs -------------------------
    stores_entries = False

    def alloc_prefix_entries(self, num_blocks: int, block_size: int, dtype, device) -> Mamba2StoredEntries:
        return Mamba2StoredEntries(torch.zeros(num_blocks * block_size, self.H, dtype=compute_dtype(dtype),
                                               device=device))

    def stored_entries(self, entries: list[Tensor]) -> list[Tensor]:
        return [entries[2]]

    def fold_stored(self, pools, pplan, start: Tensor, initial_state):
        """``ops.conv_fold``: the fold of stored positions ``start ..`` of each chain, ``x, B``
        from the conv inputs (see :meth:`SSMLayer.fold_stored`)."""
        w, b = self._conv_weight()
        return self.ops().conv_fold(pools.preconv, pools.entries.dt, pplan, start, w, b,
                                    self._A(pools.entries.dt.dtype), initial_state, head_dim=self.d, ngroups=self.G,
                                    d_state=self.n)

    def prefix_entries(self, pools, rows: Tensor, valid: Tensor) -> list[Tensor]:
        """``x, B = split(silu(conv(conv inputs)))`` at each position (its ``W`` inputs, zeros
        before the sequence start), ``Δ`` from the store."""
        xb = self._conv_rows(pools.preconv[rows], valid)
        R = rows.shape[0]
        x = xb[:, : self.inter].reshape(R, self.H, self.d)
        B = xb[:, self.inter: self.inter + self.G * self.n].reshape(R, self.G, self.n)
        return [x, B, pools.entries.dt[rows[:, -1]]]

    # ---- forward ---------------------------------------------------------------------------
    def delta(self, dt: Tensor) -> Tensor:
        """``Δ = clamp(softplus(dt + dt_bias), *time_step_limit)`` in the compute dtype, ``dt
        [.., H]`` (a slice of the projection): one launch on the GPU (``ops_for("gates")``)."""
        cdt = compute_dtype(dt.dtype)
        if fused_gates():
            return ops_for("gates").gates(dt, self._cast("dt_bias", cdt), time_step_limit=self.time_step_limit)[0]
        dt = F.softplus(dt.to(cdt) + self.dt_bias.to(cdt))
        lo, hi = self.time_step_limit
        if lo > 0.0 or hi != float("inf"):
            dt = dt.clamp(min=lo, max=hi)
        return dt

    def forward(self, h: Tensor, ctx: StepContext) -> Tensor:
        Bt, T, _ = h.shape
        zxbcdt = self.in_proj(h)
        z, xbc, dt = zxbcdt.split([self.inter, self.conv_dim, self.H], dim=-1)
        xbc = self._conv(xbc, ctx)
        x, B, C = xbc.split([self.inter, self.G * self.n, self.G * self.n], dim=-1)
        dt = self.delta(dt)
        a = {"x": x.reshape(Bt, T, self.H, self.d), "dt": dt,
             "B": B.reshape(Bt, T, self.G, self.n), "C": C.reshape(Bt, T, self.G, self.n)}
        y = self._ssm(a, ctx)
        y = self.norm(y.reshape(Bt, T, self.inter).to(h.dtype), z)
        return self.out_proj(y)

