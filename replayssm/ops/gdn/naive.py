"""Float64-capable pure-PyTorch reference ops for Gated DeltaNet (Qwen3-Next style).

Notation (``docs/MATH.md``, Notation; one value head): ``α = e^g`` with ``g <= 0``, ``β ∈ (0, 1)``,
``u_t = β_t (v_t − α_t S_{t−1} k_t)``, ``S_t = α_t S_{t−1} + u_t k_tᵀ``, ``y_t = S_t q_t``.
States are stored transposed, HF/fla layout ``St = Sᵀ ∈ [.., HV, K, V]``, so
``S x = Stᵀ x`` and ``u kᵀ`` becomes ``k ⊗ u``.  Value head ``hv`` uses key head
``hv // (HV // H)`` (GVA).  ``use_qk_l2norm`` normalises q and k as
``x / sqrt(Σx² + 1e-6)``, then q is multiplied by ``scale`` (default ``K**-0.5``).
The decay is one scalar per (token, value head): ``g [.., HV]``.

The ops are those of the one delta-rule reference, :mod:`replayssm.ops.delta_rule`, with the
scalar decay as a per-channel decay constant over K (``docs/MATH.md``; KDA's module binds the
same code with a decay per key channel).  Every form computes the same numbers as
:func:`recurrent_scan` up to rounding:

* ``recurrent_step`` / ``recurrent_scan``: the ground truth (the recurrent form);
  ``recurrent_update``: one step on a state pool, in place.
* ``chunked_prefill``: chunked WY/UT form; per chunk one unit-lower-triangular solve;
  ``chunked_prefill_varlen``: the same over a packed batch of sequences.
* ``rebuild_state`` / ``replay_decode``: GDN replay from a checkpoint ``S0`` and a ring of
  ``(u, k, g)`` (:class:`~replayssm.cache.buffers.GDNBuffers`).
* ``replay_verify`` / ``tree_verify``: speculative verify, T drafts (or a tree of N nodes) in one solve.
* ``snapshot_verify`` / ``snapshot_commit``: the serial one-state-per-draft baseline.
* ``kv_verify`` / ``kv_tree_verify`` / ``kv_fold`` / ``kv_to_state``: KV-only form (``S0 = 0``)
  over the paged blocks a row holds (:class:`~replayssm.cache.paged.GDNPagedBuffers`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...cache import paged
from ...cache.buffers import GDNBuffers
from .. import delta_rule as _d
from ..delta_rule import KV_CHUNK, l2norm, snapshot_commit

__all__ = [
    "KV_CHUNK",
    "l2norm",
    "recurrent_step",
    "recurrent_update",
    "recurrent_scan",
    "chunked_prefill",
    "rebuild_state",
    "replay_decode",
    "replay_verify",
    "snapshot_verify",
    "snapshot_commit",
    "tree_verify",
    "kv_verify",
    "kv_tree_verify",
    "kv_to_state",
    "kv_fold",
    "chunked_prefill_varlen",
]

FAMILY = _d.DeltaFamily("gdn", per_channel=False, buffers=GDNBuffers, paged_buffers=paged.GDNPagedBuffers)
_REF = _d.DeltaRuleRef(FAMILY)

recurrent_step = _REF.recurrent_step
recurrent_update = _REF.recurrent_update
recurrent_scan = _REF.recurrent_scan
chunked_prefill = _REF.chunked_prefill
chunked_prefill_varlen = _REF.chunked_prefill_varlen
rebuild_state = _REF.rebuild_state
replay_decode = _REF.replay_decode
replay_verify = _REF.replay_verify
tree_verify = _REF.tree_verify
snapshot_verify = _REF.snapshot_verify
kv_verify = _REF.kv_verify
kv_tree_verify = _REF.kv_tree_verify
kv_fold = _REF.kv_fold
kv_to_state = _REF.kv_to_state
check_rebuild_state = _REF.check_rebuild_state
check_kv_fold = _REF.check_kv_fold
check_prefill_varlen = _REF.check_prefill_varlen
_check_inputs = _REF._check_inputs
_check_buffers = _REF._check_buffers
_check_kv = _REF._check_kv


# ---------------------------------------------------------------------------- scalar-decay block helpers
# The chunk step in scalar-decay form (undecayed readouts, cumulative log-decays per head), as the
# compiled-reference benchmark (``replayssm.bench.prefill``) composes it.
def _sum_history_state(u: Tensor, k: Tensor, w: Tensor) -> Tensor:
    """``Σ_j w_j k_j ⊗ u_j`` in state layout ``[Bt, HV, K, V]`` for scalar weights ``w [Bt,J,HV]``."""
    return _d._sum_history_state(u, k, w[..., None])


def _delta_block(hk, hq, q, k, v, G, beta, mask):
    """:func:`replayssm.ops.delta_rule._delta_block` for readouts ``hk = S_h k_s``, ``hq = S_h q_s``
    ``[Bt,T,HV,V]`` not yet decayed and cumulative log-decays ``G [Bt,T,HV]`` from ``S_h``:
    ``R_s = β_s (v_s − e^{G_s} hk_s)``, ``y_s = e^{G_s} hq_s + Σ_{s'≤s} e^{G_s−G_{s'}} (k_{s'}·q_s) U_{s'}``.
    Returns ``U, y`` as ``[Bt,T,HV,V]``."""
    eG = torch.exp(G)[..., None]
    Gh = G.transpose(1, 2)  # [Bt,HV,T]
    neg_inf = torch.full((), float("-inf"), dtype=G.dtype, device=G.device)
    E = torch.where(mask[:, None], Gh[..., :, None] - Gh[..., None, :], neg_inf)[..., None]
    return _d._delta_block(eG * hk, eG * hq, q, k, v, E, beta, mask)
