"""Operators launched per decode step, per layer type: a CPU proxy for GPU kernel launches.

Runs a few greedy decode steps of a tiny preset on the CPU under a ``TorchDispatchMode``
that counts every aten operator that computes (view and metadata operators, which launch
nothing on a GPU, are left out) and every Triton kernel launch (through the interpreter:
run with ``TRITON_INTERPRET=1 REPLAYSSM_KERNELS=triton`` so that the routed ops take their
kernel path as on a GPU; the interpreter's own host copies are not counted).  Each count is
charged to the outermost mixer / MLP module running it and divided by that module type's
decode calls (``other``: norms, residual adds, embedding, head, sampling; per decode step).
The blocks' norms run their PyTorch form on the CPU (their fused kernels need CUDA)::

    TRITON_INTERPRET=1 REPLAYSSM_KERNELS=triton python -m replayssm.bench.launches --preset qwen3.5-tiny
    ... REPLAYSSM_FUSED_GATES=0 ...   # the per-call gate path, for the before column
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import tempfile

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

#: aten operators that launch no kernel (views, metadata, allocation)
_FREE = {"empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh", "_to_copy_noop", "size", "stride",
         "is_same_size", "set_", "new_empty", "new_empty_strided", "_local_scalar_dense", "item", "sym_size",
         "sym_stride", "sym_numel", "sym_storage_offset", "resize_", "promote_types"}


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.counts: collections.Counter = collections.Counter()
        self.on = False
        self.quiet = 0

    def charge(self, op: str) -> None:
        if self.on and not self.quiet:
            self.counts[(self.stack[0] if self.stack else "other", op)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (func.is_view or name in _FREE):
            self.charge(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _triton_counted(counter: _Counter):
    """Count each interpreted Triton launch once, and none of the interpreter's copies."""
    try:
        from triton.runtime import interpreter
    except Exception:  # pragma: no cover - no triton
        yield
        return
    real = interpreter.GridExecutor.__call__

    def call(self, *a, **kw):
        counter.charge("triton:" + self.fn.__name__)
        counter.quiet += 1
        try:
            return real(self, *a, **kw)
        finally:
            counter.quiet -= 1

    interpreter.GridExecutor.__call__ = call
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = real


def _layer_kind(m: nn.Module) -> str | None:
    from ..layers.ssm_base import SSMLayer

    n = type(m).__name__
    if isinstance(m, SSMLayer) or "Attention" in n or n.endswith(("MLP", "MoE")):
        return n
    return None


def count_decode(model, steps: int = 3, batch: int = 2, mode: str = "replay") -> dict:
    """``{"per_call": {layer type: {op: launches per call}}, "calls": {layer type: calls}}``
    over ``steps`` greedy decode steps of ``model`` (``other``: per step)."""
    from ..engine.config import SamplingParams
    from ..engine.llm import LLM

    counter = _Counter()
    calls: collections.Counter = collections.Counter()
    hooks = []
    for m in model.modules():
        kind = _layer_kind(m)
        if kind is None:
            continue

        def pre(mod, args, kind=kind):
            counter.stack.append(kind)
            if counter.on and len(counter.stack) == 1:
                calls[kind] += 1

        def post(mod, args, out):
            counter.stack.pop()

        hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    V = int(model.config.vocab_size)
    prompts = [[(7 * b + j) % V for j in range(5)] for b in range(batch)]
    real_decode = None
    try:
        llm = LLM(model, device="cpu", decode_mode=mode, max_num_seqs=batch, max_seq_len=64, cuda_graphs=False)
        real_decode = llm.runner.decode

        def decode(*a, **kw):
            calls["other"] += 1
            counter.on = True
            try:
                return real_decode(*a, **kw)
            finally:
                counter.on = False

        llm.runner.decode = decode
        with counter, _triton_counted(counter):
            llm.generate(prompts, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    finally:
        for h in hooks:
            h.remove()
    per = collections.defaultdict(dict)
    for (kind, op), n in sorted(counter.counts.items()):
        per[kind][op] = n / max(calls[kind], 1)
    return {"per_call": dict(per), "calls": dict(calls)}


def main() -> None:
    from .e2e import _random_model_dir
    from ..engine.loading import load

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3.5-tiny")
    p.add_argument("--mode", default="replay")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = load(_random_model_dir(a.preset, tmp), torch.device("cpu"), getattr(torch, a.dtype))[0]
    res = count_decode(model, a.steps, mode=a.mode)
    if a.json:
        print(json.dumps(res))
        return
    for kind, ops in res["per_call"].items():
        total = sum(ops.values())
        print(f"{kind:<24} {total:6.1f} launches/call  " +
              ", ".join(f"{k} {v:g}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
