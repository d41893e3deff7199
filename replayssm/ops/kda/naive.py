"""Float64-capable pure-PyTorch reference ops for KDA (Kimi Delta Attention, Kimi-Linear).

KDA is Gated DeltaNet with a log-decay per **key channel** (``docs/MATH.md``, "KDA: the
gated delta rule with a per-channel decay").  Per value head, in the HF/fla state layout
``St = Sᵀ ∈ [.., HV, K, V]`` (``S x = Stᵀ x``, ``u kᵀ`` is ``k ⊗ u``), with ``g ∈ R^K``
(``g <= 0``) and ``α = e^g``::

    St ← diag(α_t) St                 (row c of St, key channel c, scaled by α_t[c])
    u_t = β_t (v_t − Stᵀ k_t)         (= β_t (v_t − S_{t−1} (α_t ⊙ k_t)))
    St ← St + k_t ⊗ u_t               y_t = Stᵀ q_t

This is ``recurrent_kimi_delta_attention`` of transformers' ``kimi_linear`` (and fla's
``fused_recurrent_kda``).  ``use_qk_l2norm`` normalises q and k as ``x / sqrt(Σx² + 1e-6)``,
then q is multiplied by ``scale`` (default ``K**-0.5``).  Value heads ``HV`` may be a
multiple of key heads ``H`` (Kimi-Linear itself has ``HV == H``); ``g`` and ``β`` are per
value head (``g [.., HV, K]``).

The ops are those of the one delta-rule reference, :mod:`replayssm.ops.delta_rule` (the same
code serves GDN, whose scalar decay is a per-channel decay constant over K), with the forms
listed in :mod:`replayssm.ops.gdn.naive`; the caches are
:class:`~replayssm.cache.buffers.KDABuffers` and :class:`~replayssm.cache.paged.KDAPagedBuffers`.
"""

from __future__ import annotations

from ...cache import paged
from ...cache.buffers import KDABuffers
from .. import delta_rule as _d
from ..delta_rule import KV_CHUNK, l2norm, snapshot_commit

__all__ = [
    "KV_CHUNK",
    "l2norm",
    "recurrent_step",
    "recurrent_update",
    "recurrent_scan",
    "chunked_prefill",
    "chunked_prefill_varlen",
    "rebuild_state",
    "replay_decode",
    "replay_verify",
    "tree_verify",
    "snapshot_verify",
    "snapshot_commit",
    "kv_verify",
    "kv_tree_verify",
    "kv_fold",
    "kv_to_state",
]

FAMILY = _d.DeltaFamily("kda", per_channel=True, buffers=KDABuffers, paged_buffers=paged.KDAPagedBuffers)
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
