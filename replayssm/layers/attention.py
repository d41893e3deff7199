"""Grouped-query softmax attention with a per-slot KV cache.

``q = W_q x`` (optionally ``[q | gate]`` per head, Qwen3-Next), optional per-head q/k RMSNorm,
optional (partial) RoPE, ``o = softmax(q kᵀ · Dh^-1/2 + mask) v`` with KV head
``h // (H // Hkv)`` for query head ``h``, optional output gate ``o · sigmoid(gate)``, then
``W_o``.  Scores and softmax run in at least fp32.

Cache (per layer): ``k, v [P, S, Hkv, Dh]``; a row's committed tokens sit at
``0 .. seq_len-1``.  Every call writes its new tokens at ``seq_len + i`` (``i`` = token or
tree-node index) and attends to the committed prefix plus the allowed new tokens (causal
chain, or the ancestor-or-self mask of a tree).  ``commit`` keeps accepted entries: chains
need no move; trees copy node ``path[i]`` to ``seq_len + i``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .context import StepContext
from .mlp import Linear
from ..runtime import compute_dtype
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
    def allocate(self, P: int, S: int, dtype, device) -> dict:
        z = dict(dtype=dtype, device=device)
        return {"k": torch.zeros(P, S, self.Hkv, self.Dh, **z), "v": torch.zeros(P, S, self.Hkv, self.Dh, **z)}

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
        s = torch.einsum("btgrd,bsgd->bgrts", qg, K.to(cdt)) * (self.Dh ** -0.5)
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
            mask = (t[None, :] <= t[:, None]).expand(B, T, T)
            o = self._attend(q, k, v, mask)
        else:
            store = ctx.cache.layers[self.layer_id]
            Kc, Vc = store["k"], store["v"]
            S = Kc.shape[1]
            i = torch.arange(T, device=x.device)
            wpos = ctx.seq_len[:, None] + i[None, :]              # [B, T] cache rows written
            rows = ctx.slots[:, None].expand(B, T)
            if ctx.valid is not None:  # prefill padding writes go to the null slot
                rows = torch.where(ctx.valid, rows, torch.zeros_like(rows))
                wpos_w = torch.where(ctx.valid, wpos, torch.zeros_like(wpos))
            else:
                wpos_w = wpos
            Kc[rows, wpos_w] = k.to(Kc.dtype)
            Vc[rows, wpos_w] = v.to(Vc.dtype)
            j = torch.arange(S, device=x.device)
            if ctx.kind == "tree":
                rel = j[None, :] - ctx.seq_len[:, None]             # [B, S] node index of row j
                committed = rel < 0
                relc = rel.clamp(0, T - 1)
                in_tree = (rel >= 0) & (rel < T)
                anc = torch.gather(ctx.anc, 2, relc[:, None, :].expand(B, T, S))  # [B, T, S]
                mask = committed[:, None, :] | (in_tree[:, None, :] & anc)
            else:
                mask = j[None, None, :] <= wpos[:, :, None]
                if ctx.lengths is not None:  # prefill: padded queries read only written keys
                    mask = mask & (j[None, :] < (ctx.seq_len + ctx.lengths)[:, None])[:, None, :]
            o = self._attend(q, Kc[ctx.slots], Vc[ctx.slots], mask)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    # ------------------------------------------------------------------ commit
    def commit(self, ctx: StepContext, accepted: Tensor, path: Tensor | None) -> None:
        if ctx.kind != "tree" or path is None:
            return
        store = ctx.cache.layers[self.layer_id]
        N = ctx.T
        i = torch.arange(N, device=accepted.device)
        src = torch.where(i[None, :] < accepted[:, None], path.long(), i[None, :])
        dst = ctx.seq_len[:, None] + i[None, :]
        srcp = ctx.seq_len[:, None] + src
        rows = ctx.slots[:, None]
        for name in ("k", "v"):
            buf = store[name]
            vals = buf[rows, srcp]
            buf[rows, dst] = vals
