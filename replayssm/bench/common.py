"""Small helpers the benchmarks share: waiting for the device, releasing its memory, and
building (or reusing) random-weight models."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from ..engine.config import SamplingParams


def sync(device) -> None:
    """Wait for ``device``'s queued work (no-op on CPU)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def graph_replay_ms(fn, reps: int = 20) -> float:
    """Milliseconds per replay of ``fn`` captured in a CUDA graph (warmed up on a side
    stream first; wall clock over ``reps`` replays, synchronised)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def warm_then_time(llm, warm, prompts, params: SamplingParams, device, on_warm=None):
    """Run ``warm`` prompts for a few tokens (kernels compile, graphs capture), zero the
    engine's counters (and call ``on_warm``), then time ``llm.generate(prompts, params)``
    between device syncs; returns ``(outputs, wall seconds)``."""
    llm.generate(warm, SamplingParams(max_tokens=min(4, params.max_tokens), ignore_eos=True))
    for k in llm.stats:
        llm.stats[k] = 0 if isinstance(llm.stats[k], int) else 0.0
    if on_warm is not None:
        on_warm()
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(device)
    return outs, time.perf_counter() - t0


def draft_length_steps(stats: dict) -> dict[int, int]:
    """``{T: steps}`` of the engine's ``spec_T<T>_steps`` counters (the draft lengths its
    length policy chose; 0: plain decode steps)."""
    return {int(k[6:-6]): int(v) for k, v in sorted(stats.items(), key=lambda kv: kv[0])
            if k.startswith("spec_T") and k.endswith("_steps")}


def fastest_run(llm, prompts, params: SamplingParams, device, repeats: int = 1, on_warm=None,
                extra: Callable[[], dict] | None = None) -> dict:
    """The fastest (decode tokens/s) of ``repeats`` runs of :func:`warm_then_time` with
    ``prompts`` as their own warm-up: ``{tokens_per_s, wall_s, generated, decode_s,
    decode_tokens_per_s, outputs, mean_accepted_length, draft_lengths}`` plus ``extra()``,
    read right after each run (the first token of each request comes from prefill, so decode
    tokens/s counts the rest)."""
    best = None
    for _ in range(repeats):
        outs, wall = warm_then_time(llm, prompts, prompts, params, device, on_warm=on_warm)
        stats = dict(llm.stats)
        gen = sum(len(o.token_ids) for o in outs)
        row = {"tokens_per_s": gen / wall, "wall_s": wall, "generated": gen, "decode_s": stats["decode_s"],
               "decode_tokens_per_s": (gen - len(outs)) / max(stats["decode_s"], 1e-9),
               "outputs": [o.token_ids for o in outs],
               "mean_accepted_length": sum(o.mean_accepted_length for o in outs) / len(outs),
               "draft_lengths": draft_length_steps(stats), **(extra() if extra is not None else {})}
        if best is None or row["decode_tokens_per_s"] > best["decode_tokens_per_s"]:
            best = row
    return best


def graph_kernels(llm, batch: int, replays: int = 10, **replay_kw) -> list[tuple[str, float, float]]:
    """The kernels of ``llm``'s captured decode graph of ``batch`` rows, from ``replays``
    back-to-back replays under ``torch.profiler`` (``runner.replay_ms``: the step's kernels
    only, no host work): ``(name, µs per step, launches per step)``, slowest first; torch
    operator and runtime-call entries left out (their kernels are listed themselves)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.runner.replay_ms(batch, replays, **replay_kw)
        torch.cuda.synchronize()
    n = replays + 1   # replay_ms replays once before its timed replays
    ks = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0
          and not e.key.startswith(("aten::", "c10d::", "record_param", "cuda"))]
    return sorted(((e.key, e.device_time_total / n, e.count / n) for e in ks), key=lambda r: -r[1])


def free_memory(device) -> None:
    """Collect garbage and return the caching allocator's free blocks (after an engine is dropped)."""
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


#: environment variable naming a folder where random-weight benchmark models are kept and
#: reused (several benchmarks in one session build the same 2.7B/4B model once)
RANDOM_MODEL_CACHE = "REPLAYSSM_RANDOM_MODEL_CACHE"
#: bump when a random-weight recipe changes the values it draws for the same config and seed
RANDOM_RECIPE = 1


def random_model_dir(root, name: str, key: dict, build: Callable[[Path], None]) -> str:
    """The directory of a random-weight model ``name``: ``build(dir)`` writes it under ``root``;
    when ``$REPLAYSSM_RANDOM_MODEL_CACHE`` names a folder, it is built there once per ``key``
    (config, seed, whatever sets the values; plus :data:`RANDOM_RECIPE`) and reused.

    Users of a cached directory must not write into it (copy it first)."""
    cache = os.environ.get(RANDOM_MODEL_CACHE)
    if not cache:
        d = Path(root) / name
        d.mkdir(parents=True, exist_ok=True)
        build(d)
        return str(d)
    digest = hashlib.sha256(json.dumps({**key, "recipe": RANDOM_RECIPE}, sort_keys=True,
                                       default=str).encode()).hexdigest()[:12]
    d = Path(cache) / f"{name}-{digest}"
    if (d / ".complete").is_file():
        return str(d)
    tmp = Path(cache) / f".{d.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp)
    (tmp / ".complete").touch()
    try:
        tmp.rename(d)
    except OSError:          # another process finished it first, or a stale incomplete one
        if (d / ".complete").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(d, ignore_errors=True)
            tmp.rename(d)
    return str(d)


def private_copy(model_dir: str, dst) -> str:
    """A copy of ``model_dir`` at ``dst`` that may be written: weight files hard-linked when
    the filesystem allows (they must then be replaced, never written in place), the rest copied."""
    def link_weights(src, target):
        if src.endswith(".safetensors"):
            try:
                os.link(src, target)
                return target
            except OSError:
                pass
        return shutil.copy2(src, target)

    return shutil.copytree(model_dir, dst, copy_function=link_weights)
