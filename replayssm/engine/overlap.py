"""Async scheduling: the host prepares decode step ``n+1`` while the device runs step ``n``.

A synchronous engine step is schedule -> launch -> wait for the sampled tokens ->
postprocess, so the device idles through all host work.  With ``async_scheduling`` the
engine keeps at most one decode step in flight (:class:`InFlight`): the sequences in row
order, the greedy tokens ``[B]`` on the device and their copy on its way to the host.  A
step then

1. picks the rows of step ``n+1``: step ``n``'s sequences minus those the host already
   knows end with step ``n``'s token (aborted, or reaching ``max_tokens`` / the context
   limit with the pending token: :func:`ends_with_pending`);
2. reserves their blocks for two more tokens (the pending one and the new one) and
   launches step ``n+1`` with its input tokens gathered on the device from step ``n``'s
   output (``ModelRunner.decode_rows``: no host round trip), its tokens' copy to the host
   queued behind it;
3. only then waits for step ``n``'s tokens and postprocesses them as the synchronous engine
   does (stop tokens, stop strings, lengths; finished sequences freed).

A sequence that step ``n``'s token ends (EOS, a stop string) already has a row in step
``n+1``: that row is wasted, its token dropped when step ``n+1`` is collected.  Its slot is
released right away all the same: the release (and any later use of the blocks it returns)
is device work queued on the same stream after step ``n+1``, so the wasted row's writes
land before the slot is reset; on the host a freed slot is handed out again only by the
scheduler, which runs only when no step is in flight.

Only plain greedy decode steps overlap (``executor.plain_rows`` and the engine's
conditions); every other step first collects the one in flight and runs synchronously.
Greedy tokens do not depend on when the host reads them, so outputs are exactly those of
the synchronous engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .sequence import Sequence

#: decode modes whose steps may overlap: the ``auto`` policy switches forms from host
#: lengths after each step, and ``kv`` serves short contexts where host time is small anyway
OVERLAP_MODES = ("replay", "recurrent")


def ends_with_pending(s: Sequence, token_limit: int) -> bool:
    """Whether ``s`` ends with the token still in flight whatever it is: ``max_tokens`` or
    the context limit (``token_cap``, else ``token_limit``) reached once it is appended."""
    cap = s.token_cap if s.token_cap is not None else token_limit
    return len(s.output_ids) + 1 >= s.params.max_tokens or s.num_tokens + 1 >= cap


@dataclass
class InFlight:
    """One launched decode step: ``seqs`` in row order, the greedy ``tokens [B]`` on the
    device, ``host`` their copy (pinned on CUDA, landing when ``event`` completes) and
    ``lagged`` (fed from the previous step's tokens on the device)."""

    seqs: list[Sequence]
    tokens: Tensor
    host: Tensor
    event: object = None
    lagged: bool = False

    @classmethod
    def launched(cls, seqs: list[Sequence], tokens: Tensor, lagged: bool = False) -> "InFlight":
        """Queue the copy of ``tokens`` to the host behind the step (on CUDA into pinned
        memory, with an event; elsewhere a copy: the runner's output may be a graph's static
        buffer that the next step overwrites)."""
        if tokens.device.type == "cuda":
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return cls(list(seqs), tokens, host, event, lagged)
        return cls(list(seqs), tokens, tokens.clone(), None, lagged)

    def rows_of(self, seqs: list[Sequence]) -> list[int]:
        """Row of each of ``seqs`` (a subset, in order) in this step."""
        at = {id(s): b for b, s in enumerate(self.seqs)}
        return [at[id(s)] for s in seqs]

    def wait(self) -> list[int]:
        """The step's tokens on the host (blocks until its copy has landed)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
