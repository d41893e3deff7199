"""Multi-head latent attention (MLA, DeepSeek-V2 style) without rotary embeddings
(HF ``KimiLinearAttention``: Kimi-Linear's MLA layers are NoPE; transformers applies no rope).

Per token ``x`` (``H`` heads; ``dn`` / ``dr`` the q·k head dims without / with the shared
part, ``dv`` the value head dim, ``R = kv_lora_rank``)::

    q_h = W_q x  (or W_qb rms(W_qa x)),  q_h = [q_nope_h (dn) | q_rot_h (dr)]
    [c | k_rot] = W_kva x,  c = rms(c)                   (the latent (R) and the shared key part (dr))
    k_h = [W_uk_h c | k_rot],  v_h = W_uv_h c            (kv_b_proj rows per head: [W_uk_h (dn) | W_uv_h (dv)])
    o_h = softmax(q_h·k_j · (dn + dr)^-1/2) v_h,  out = o_proj([o_1 .. o_H])

computed in the absorbed form: ``q_h·k_j = [W_uk_hᵀ q_nope_h | q_rot_h]·[c_j | k_rot_j]``
and ``o_h = W_uv_h Σ_j p_hj c_j``, i.e. multi-query attention with one key/value head
``[c | k_rot]`` of ``R + dr`` channels: the paged cache stores that vector once per token
(the key and value pools are one tensor; the value's first ``R`` channels are read).  Decode,
verify and tree steps run ``ops_for("attention").mla_attention`` (one read of each cached
latent for scores and values, all heads of a sequence in one program); prefill runs the
generic ``paged_attention`` over the same pool.  The q_a / kv_a norms use
``eps = 1e-6`` (transformers builds them without the config's ``rms_norm_eps``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels.dispatch import ops_for
from .attention import Attention
from .context import StepContext
from .mlp import Linear
from .norms import RMSNorm

#: transformers' KimiLinearRMSNorm default, used by the latent norms
LATENT_NORM_EPS = 1e-6


class MLAttention(Attention):
    def __init__(self, hidden: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_dim: int, qk_rope_dim: int, v_dim: int, *, bias: bool = False, layer_id: int = 0):
        nn.Module.__init__(self)
        self.H, self.Hkv, self.Dh = num_heads, 1, kv_lora_rank + qk_rope_dim
        self.R, self.dn, self.dr, self.dv = kv_lora_rank, qk_nope_dim, qk_rope_dim, v_dim
        self.scale = (qk_nope_dim + qk_rope_dim) ** -0.5
        self.output_gate, self.rotary, self.layer_id = False, None, layer_id
        self.q_norm = self.k_norm = None
        dq = num_heads * (qk_nope_dim + qk_rope_dim)
        if q_lora_rank is None:
            self.q_proj = Linear(hidden, dq)
        else:
            self.q_a_proj = Linear(hidden, q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(q_lora_rank, dq)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = Linear(hidden, kv_lora_rank + qk_rope_dim, bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_dim + v_dim))
        self.o_proj = Linear(num_heads * v_dim, hidden, bias)

    def allocate(self, num_blocks: int, block_size: int, dtype, device) -> dict:
        """One pool ``[num_blocks, block_size, 1, R + dr]`` under both names (key = value)."""
        pool = torch.zeros((num_blocks, block_size, 1, self.Dh), dtype=dtype, device=device)
        return {"k": pool, "v": pool}

    def commit(self, ctx: StepContext, accepted: Tensor, path: Tensor | None) -> None:
        """The tree commit's moves, once (the key and value pools are one tensor: moving
        both would move the already moved rows again)."""
        if ctx.kind != "tree" or path is None:
            return
        store = ctx.cache.layers[self.layer_id]
        N, bs = ctx.T, store["k"].shape[1]
        i = torch.arange(N, device=accepted.device)
        src = torch.where(i[None, :] < accepted[:, None], path.long(), i[None, :])

        def flat(pos: Tensor) -> Tensor:
            return ctx.attn_table.gather(1, pos // bs) * bs + pos % bs

        pool = store["k"].view(-1, self.Dh)
        pool[flat(ctx.seq_len[:, None] + i[None, :])] = pool[flat(ctx.seq_len[:, None] + src)]

    def _up(self) -> tuple[Tensor, Tensor]:
        """``(W_uk [H, dn, R], W_uv [H, dv, R])`` from ``kv_b_proj``."""
        w = self.kv_b_proj.weight.view(self.H, self.dn + self.dv, self.R)
        return w[:, :self.dn], w[:, self.dn:]

    def _qkv(self, x: Tensor, positions: Tensor):
        """Absorbed queries ``[B,T,H,R+dr]`` and the latent key = value ``[B,T,1,R+dr]``."""
        B, T, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, self.H, self.dn + self.dr)
        w_uk, _ = self._up()
        q_lat = torch.einsum("bthn,hnr->bthr", q[..., :self.dn], w_uk)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.R, self.dr], dim=-1)
        kv = torch.cat([self.kv_a_layernorm(c), k_rot], -1).view(B, T, 1, self.Dh)
        return torch.cat([q_lat, q[..., self.dn:]], -1), kv, kv, None

    def forward(self, x: Tensor, ctx: StepContext) -> Tensor:
        B, T, _ = x.shape
        q, k, v, _ = self._qkv(x, ctx.positions)
        if ctx.cache is None:
            t = torch.arange(T, device=x.device)
            o = self._attend(q, k, v, (t[None, :] <= t[:, None]).expand(B, T, T))
            o = o.view(B, T, self.H, self.Dh)[..., :self.R]
        else:   # prefill (packed) and decode / verify / tree steps: the MLA kernel on CUDA
            o = self._latent_step(q, k, ctx)
        _, w_uv = self._up()
        o = torch.einsum("bthr,hvr->bthv", o, w_uv).reshape(B, T, self.H * self.dv)
        return self.o_proj(o)

    def _latent_step(self, q: Tensor, kv: Tensor, ctx: StepContext) -> Tensor:
        """Write the new latents ``kv [B, T, 1, R+dr]``, then ``ops.mla_attention`` (the MLA
        kernel on CUDA: each cached latent read once for scores and values); returns the
        latent outputs ``[B, T, H, R]`` (before ``W_uv``).  Decode / verify / tree steps: row
        ``b``'s ``T`` queries are the last of ``seq_len + T`` positions.  Prefill runs packed
        (``B = 1``; row ``b`` owns ``cu_seqlens[b]:[b+1]`` of the stream, causal over
        ``seq_len + lengths`` keys) — the generic paged kernel cannot hold a 576-wide head at
        Kimi-Linear's rank 512 in shared memory on an H200 (it asked for 786 KiB)."""
        B, T = q.shape[:2]
        ops = ops_for("attention")
        pool = ctx.cache.layers[self.layer_id]["k"]
        table = ctx.attn_table
        if ctx.kind == "prefill":
            cu, kv_lens = ctx.cu_seqlens, ctx.seq_len + ctx.lengths
        else:
            cu = torch.arange(B + 1, device=q.device) * T
            kv_lens = ctx.seq_len + T
        bits = None
        if ctx.kind == "tree":
            if ctx.tree_bits is None:
                raise ValueError(f"a draft tree of {T} nodes is too large for attention layers (at most 31)")
            bits = ctx.tree_bits
        qf, kf = q.reshape(B * T, self.H, self.Dh), kv.reshape(B * T, 1, self.Dh)
        ops.write_kv(pool, pool, kf, kf, ops.new_slots(table, cu, kv_lens, pool.shape[1], B * T))
        o = ops.mla_attention(qf, pool, table, cu, kv_lens, rank=self.R, scale=self.scale, tree_bits=bits)
        return o.view(B, T, self.H, self.R)
