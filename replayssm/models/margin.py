"""The greedy-margin recipe for random weights (benchmark checkpoints, random TP shards,
random MTP heads).

With small random weights everywhere the logits are nearly flat, so bf16 rounding in the
verify and decode paths flips near-ties and a precomputed greedy continuation (an oracle
drafter's) goes stale after a few tokens.  The recipe keeps the compute and changes only
the values:

* embeddings ``E ~ N(0, 1)`` of shape ``[V, D]``;
* an untied head ``W[j] = E[perm[j]] / sqrt(D)`` for a fixed permutation ``perm``
  (:func:`permuted_head`);
* every residual branch's output projection (the matrix whose product is added to the
  residual stream; :func:`residual_outputs`) at ``scale / sqrt(L)`` for ``L`` layers
  (:func:`branch_scale`), the other matrices at ``scale``.

The residual stream then stays close to ``E[t]`` for the current token ``t``, so
``logits[j] ~ E[perm[j]] . E[t] / sqrt(D)`` peaks at ``j = perm^-1(t)`` by about
``sqrt(D)`` standard deviations of the other logits.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

__all__ = ["RESIDUAL_OUTPUTS", "branch_scale", "embedding_name", "permuted_head", "residual_outputs"]

#: name endings of the residual output projections of every family in :mod:`.registry`:
#: Mamba-2 / GDN / KDA ``out_proj`` (``o_proj`` for KDA), attention and MLA ``o_proj``, MLP
#: and shared-expert ``down_proj.weight``, routed experts' ``down_proj`` (one ``[E, D, I]``
#: parameter), Granite-4.0-H's ``output_linear`` (experts and shared MLP), Nemotron-H's
#: latent MoE ``fc2_latent_proj``
RESIDUAL_OUTPUTS = ("out_proj.weight", "o_proj.weight", "down_proj.weight", "down_proj", "output_linear.weight",
                    "fc2_latent_proj.weight")

#: name endings of the token embedding (``[V, D]``) across the families
EMBEDDINGS = ("embeddings.weight", "embed_tokens.weight")


def residual_outputs(model: nn.Module) -> frozenset[str]:
    """Names of ``model``'s parameters that are residual branch output projections: those
    ending in :data:`RESIDUAL_OUTPUTS`, except where the product does not reach the
    residual stream:

    * the routed experts' ``down_proj`` of a latent MoE (it writes the latent width;
      ``fc2_latent_proj`` maps it back and is the branch output);
    * Zamba2's shared transformer (its attention output is normalised before its MLP, and
      the MLP's output goes through the hybrid layer's ``linear`` into the Mamba-2 input;
      the Mamba-2 ``out_proj`` is what the layer adds to the residual stream).

    Works on a ``meta``-device model (names and modules only)."""
    out = set()
    for name, _ in model.named_parameters():
        if not name.endswith(RESIDUAL_OUTPUTS) or "shared_transformer." in name:
            continue
        owner, _, leaf = name.rpartition(".")
        if leaf == "down_proj" and owner.endswith("experts"):
            moe = model.get_submodule(owner.rpartition(".")[0]) if "." in owner else model
            if getattr(moe, "fc2_latent_proj", None) is not None:
                continue
        out.add(name)
    return frozenset(out)


def branch_scale(scale: float, layers: int) -> float:
    """Standard deviation of a residual output projection: ``scale / sqrt(max(layers, 1))``."""
    return scale / math.sqrt(max(int(layers), 1))


def embedding_name(model: nn.Module) -> str | None:
    """Name of ``model``'s token embedding parameter (None if it has none)."""
    return next((n for n, _ in model.named_parameters() if n.endswith(EMBEDDINGS)), None)


def permuted_head(emb: Tensor, perm: Tensor) -> Tensor:
    """The recipe's ``lm_head`` rows ``emb[perm] / sqrt(D)`` in float32; ``emb [V, D]``,
    ``perm [V']`` row indices (``V' <= V``: a shard's rows)."""
    if emb.dim() != 2 or perm.dim() != 1:
        raise ValueError(f"permuted_head: expected emb [V, D] and perm [V'], got {list(emb.shape)} and "
                         f"{list(perm.shape)}")
    return emb.float()[perm] / math.sqrt(emb.shape[1])
