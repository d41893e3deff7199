"""Grouped-query softmax attention over a paged KV cache.

``q = W_q x`` (optionally ``[q | gate]`` per head, Qwen3-Next), optional per-head q/k RMSNorm,
optional (partial) RoPE, ``o = softmax(q kᵀ · Dh^-1/2 + mask) v`` with KV head
``h // (H // Hkv)`` for query head ``h``, optional output gate ``o · sigmoid(gate)``, then
``W_o``.  Scores and softmax run in at least fp32.

Cache (per layer): ``k, v [num_blocks, block_size, Hkv, Dh]`` pools; a slot's key ``j`` sits
in block ``cache.attn.block_table[slot, j // block_size]`` (the cache's attention
:class:`~replayssm.cache.paged.PagedIndex`, shared by all attention layers; blocks are
reserved as the context grows).  Every call writes its new tokens at positions
``seq_len + i`` (``i`` = token or tree-node index) and attends to the committed prefix plus
the allowed new tokens (causal chain, or the ancestor-or-self bits of a tree), through
``ops_for("attention")`` (Triton kernels on CUDA, the blockwise reference elsewhere): its
cost follows each sequence's real context.  ``commit`` keeps accepted entries: chains need
no move; trees copy node ``path[i]`` to ``seq_len + i``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels.dispatch import ops_for
from ..runtime import compute_dtype
from .context import StepContext
from .mlp import Linear
from .norms import RMSNorm
from .rotary import Rotary


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 bias: bool = False, qk_norm_eps: float | None = None, output_gate: bool = False,
                 rotary: Rotary | None = None, layer_id: int = 0):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.H, self.Hkv, self.Dh = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5   # the softmax scale (MLA: its q·k head dim, not Dh)
        self.output_gate, self.rotary, self.layer_id = output_gate, rotary, layer_id
        self.q_proj = Linear(hidden, num_heads * head_dim * (2 if output_gate else 1), bias)
        self.k_proj = Linear(hidden, num_kv_heads * head_dim, bias)
        self.v_proj = Linear(hidden, num_kv_heads * head_dim, bias)
        self.o_proj = Linear(num_heads * head_dim, hidden, bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, zero_centered=True)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, zero_centered=True)
        else:
            self.q_norm = self.k_norm = None

    # ------------------------------------------------------------------ cache
    def allocate(self, num_blocks: int, block_size: int, dtype, device) -> dict:
        """This layer's KV pools (block 0 is the null block padding rows write to)."""
        z = dict(dtype=dtype, device=device)
        shape = (num_blocks, block_size, self.Hkv, self.Dh)
        return {"k": torch.zeros(shape, **z), "v": torch.zeros(shape, **z)}

    # ------------------------------------------------------------------ forward
    def _qkv(self, x: Tensor, positions: Tensor):
        B, T, _ = x.shape
        q = self.q_proj(x)
        gate = None
        if self.output_gate:
            q, gate = q.view(B, T, self.H, 2 * self.Dh).chunk(2, dim=-1)
            gate = gate.reshape(B, T, self.H * self.Dh)
        q = q.reshape(B, T, self.H, self.Dh)
        k = self.k_proj(x).view(B, T, self.Hkv, self.Dh)
        v = self.v_proj(x).view(B, T, self.Hkv, self.Dh)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(positions, x.dtype)
            q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        return q, k, v, gate

    def _attend(self, q: Tensor, K: Tensor, V: Tensor, mask: Tensor) -> Tensor:
        """q ``[B,T,H,D]``, K/V ``[B,S,Hkv,D]``, mask ``[B,T,S]`` bool -> ``[B,T,H*D]``."""
        B, T = q.shape[:2]
        cdt = compute_dtype(q.dtype)
        r = self.H // self.Hkv
        qg = q.reshape(B, T, self.Hkv, r, self.Dh).to(cdt)
        s = torch.einsum("btgrd,bsgd->bgrts", qg, K.to(cdt)) * self.scale
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
        p = torch.softmax(s, -1)
        # rows with nothing allowed (never happens for valid rows) would be NaN: zero them
        p = torch.nan_to_num(p, nan=0.0)
        # keys no query may read can hold anything (NaN in tests): zero them, never 0 * NaN
        V = torch.where(mask.any(1)[:, :, None, None], V, torch.zeros((), dtype=V.dtype, device=V.device))
        o = torch.einsum("bgrts,bsgd->btgrd", p, V.to(cdt))
        return o.reshape(B, T, self.H * self.Dh).to(q.dtype)

    def forward(self, x: Tensor, ctx: StepContext) -> Tensor:
        B, T, _ = x.shape
        q, k, v, gate = self._qkv(x, ctx.positions)
        if ctx.cache is None:
            t = torch.arange(T, device=x.device)
            o = self._attend(q, k, v, (t[None, :] <= t[:, None]).expand(B, T, T))
        else:
            o = self._paged(q, k, v, ctx)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def _paged(self, q: Tensor, k: Tensor, v: Tensor, ctx: StepContext) -> Tensor:
        """Write the new keys/values into the slots' blocks, attend over each row's context.

        Prefill runs packed (row ``b``'s ``lengths[b]`` tokens at ``cu_seqlens[b]:[b+1]`` of
        one stream); decode / verify / tree steps run ``T`` queries per row, the last ``T``
        positions of ``seq_len + T`` keys (a tree masks by its ancestor bits)."""
        B, T = q.shape[:2]
        ops = ops_for("attention")
        store = ctx.cache.layers[self.layer_id]
        Kc, Vc = store["k"], store["v"]
        bs = Kc.shape[1]
        table = ctx.attn_table
        if ctx.kind == "prefill":   # packed: q/k/v are [1, Nt, ...], row b owns cu_seqlens[b]:[b+1]
            cu = ctx.cu_seqlens
            kv_lens = ctx.seq_len + ctx.lengths
            qf, kf, vf = q[0], k[0], v[0]
            bits = None
        else:
            cu = torch.arange(B + 1, device=q.device) * T
            kv_lens = ctx.seq_len + T
            qf, kf, vf = (t.reshape(B * T, *t.shape[2:]) for t in (q, k, v))
            bits = None
            if ctx.kind == "tree":
                if ctx.tree_bits is None:
                    raise ValueError(f"a draft tree of {T} nodes is too large for attention layers (at most 31)")
                bits = ctx.tree_bits
        ops.write_kv(Kc, Vc, kf, vf, ops.new_slots(table, cu, kv_lens, bs, qf.shape[0]))
        of = ops.paged_attention(qf, Kc, Vc, table, cu, kv_lens, scale=self.scale, tree_bits=bits)
        return of.reshape(B, T, self.H * self.Dh)

    # ------------------------------------------------------------------ commit
    def commit(self, ctx: StepContext, accepted: Tensor, path: Tensor | None) -> None:
        """After a tree verify, move the accepted path's keys/values to ``seq_len + i``
        (read every source before writing: the moves may overlap)."""
        if ctx.kind != "tree" or path is None:
            return
        store = ctx.cache.layers[self.layer_id]
        N, bs = ctx.T, store["k"].shape[1]
        i = torch.arange(N, device=accepted.device)
        src = torch.where(i[None, :] < accepted[:, None], path.long(), i[None, :])

        def flat(pos: Tensor) -> Tensor:            # [B, N] positions -> flat pool rows
            return ctx.attn_table.gather(1, pos // bs) * bs + pos % bs

        rows_src, rows_dst = flat(ctx.seq_len[:, None] + src), flat(ctx.seq_len[:, None] + i[None, :])
        for name in ("k", "v"):
            pool = store[name].view(-1, self.Hkv, self.Dh)
            pool[rows_dst] = pool[rows_src]
