"""Where a tensor-parallel decode step spends its time (two GPUs).

1. All-reduce latency inside a CUDA graph, per message size of a decode step
   (``[B, D]`` bf16 partial outputs; the deferred-norm message ``[B, D + 1]`` fp32), for
   NCCL and the one-shot symmetric-memory path of :class:`replayssm.distributed.allreduce.AllReduce`.
2. The control message: rank 0's ``broadcast_object_list`` of a decode step's call.
3. End to end: the 2.7B preset, decode tokens/s TP=1 vs TP=2 with each all-reduce method
   (``REPLAYSSM_TP_ALLREDUCE``) and with the fused sub-block finish on or off
   (``REPLAYSSM_TP_FUSED``: a config's fourth field), replay (and recurrent) mode; the step
   time and the captured graph alone (``replay_ms``) per config; startup times.  Each config
   runs in a process of its own (``replayssm.bench.isolated``: a TP group whose teardown was
   given up leaves ``torch.distributed`` initialised, so no second group could start in the
   same process) and sends one result back, also printed as a ``CONFIG {json}`` line.
4. A profiler table of rank 0's TP=2 decode steps (CUDA kernels and host ops), and of TP=1's
   (``--profile-batch``: their batch, default 64).

Run with NVLink multicast off (the machine's environment).  ``--budget-s`` stops starting
new parts past that wall time.  Writes ``profile_tp.json`` under ``$OUT`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

T0 = time.perf_counter()


def _elapsed() -> float:
    return time.perf_counter() - T0


# ---------------------------------------------------------------------------------------------
# 1 + 2: collectives and the control message (spawned ranks)
# ---------------------------------------------------------------------------------------------
SHAPES = [((1, 2560), torch.bfloat16), ((64, 2560), torch.bfloat16), ((256, 2560), torch.bfloat16),
          ((64, 2561), torch.float32), ((256, 2561), torch.float32)]


def _micro(rank: int, size: int, port: int, q) -> None:
    from replayssm.distributed.allreduce import AllReduce

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=size, device_id=dev)
    control = dist.new_group(backend="gloo")
    rows = []
    for method in ("nccl", "symm"):
        try:
            ar = AllReduce(None, dev, method)
        except RuntimeError as e:
            rows.append({"method": method, "error": str(e)})
            continue
        for shape, dt in SHAPES:
            g = torch.Generator(device=dev).manual_seed(rank)
            x0 = torch.randn(shape, generator=g, device=dev).to(dt)
            want = sum(torch.randn(shape, generator=torch.Generator(device=dev).manual_seed(r), device=dev).to(dt).float()
                       for r in range(size))
            K = 32
            xs = [x0.clone() for _ in range(K)]
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for x in xs[:2]:
                    ar(x.clone())
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            outs = []
            with torch.cuda.graph(graph):
                for x in xs:
                    outs.append(ar(x))
            graph.replay()
            torch.cuda.synchronize()
            err = max(float((o.float() - want).abs().max()) for o in outs)
            dist.barrier()
            reps = 20
            t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graph.replay()
            t[0].record()
            for _ in range(reps):
                graph.replay()
            t[1].record()
            torch.cuda.synchronize()
            us = t[0].elapsed_time(t[1]) * 1e3 / (reps * K)
            rows.append({"method": ar.method, "asked": method, "shape": list(shape), "dtype": str(dt),
                         "bytes": x0.numel() * x0.element_size(), "us_per_allreduce": us, "max_err": err})
            del graph, outs, xs
    # the control message of one decode step (slots + a tensor placeholder), rank 0 -> all
    msg = ("call", (3, "decode", (list(range(64)), "T0"), {}, None), [])
    lat = []
    for i in range(300):
        dist.barrier(group=control)
        a = time.perf_counter()
        box = [msg if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=control)
        lat.append(time.perf_counter() - a)
    lat = sorted(lat[50:])
    if rank == 0:
        q.put({"allreduce": rows, "control_msg_us": {"median": lat[len(lat) // 2] * 1e6, "p90": lat[int(len(lat) * .9)] * 1e6}})
    dist.destroy_process_group()


def micro() -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = 29000 + os.getpid() % 1000
    ps = [ctx.Process(target=_micro, args=(r, 2, port, q)) for r in range(2)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(300)
    return q.get() if not q.empty() else {"error": [p.exitcode for p in ps]}


# ---------------------------------------------------------------------------------------------
# 3 + 4: end to end
# ---------------------------------------------------------------------------------------------
#: (TP, control channel, all-reduce method, REPLAYSSM_TP_FUSED)
CONFIGS = [(1, "gloo", "nccl", "1"), (2, "shm", "auto", "0"), (2, "shm", "auto", "1"), (2, "shm", "nccl", "1")]


def _close_with_watchdog(model, what: str, limit_s: float = 60.0) -> None:
    """``model.close()``; if it has not returned after ``limit_s``, print every thread's stack."""
    import faulthandler
    import threading

    t0 = time.perf_counter()
    th = threading.Thread(target=model.close, daemon=True)
    th.start()
    th.join(limit_s)
    if th.is_alive():
        print(f"[{_elapsed():.0f}s] {what}: close() still running after {limit_s:.0f} s; stacks:", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        raise SystemExit(3)
    print(f"[{_elapsed():.0f}s] {what}: closed in {time.perf_counter() - t0:.1f} s", flush=True)


def _print_profile(prof: dict) -> None:
    if prof.get("kernels"):
        print(f"rank-0 decode graph kernels (µs per step, launches per step; all kernels "
              f"{prof['kernels_total_us']:.0f} µs):")
        for k, us, n in prof["kernels"]:
            print(f"  {us:9.1f} {n:6.0f}  {k}")
    print("rank-0 CUDA time (ms, calls):")
    for k, ms, n in prof["cuda"]:
        print(f"  {ms:9.2f} {n:6d}  {k}")
    print("rank-0 host self time (ms, calls):")
    for k, ms, n in prof["cpu_self"]:
        print(f"  {ms:9.2f} {n:6d}  {k}")
    sys.stdout.flush()


def _one_config(path: str, config: tuple, batches, modes, budget_s: float, profile: bool,
                profile_batch: int = 64) -> dict:
    """One TP config end to end, in a fresh process (:func:`replayssm.bench.isolated.run_isolated`):
    load, decode rows, the optional profile; returns ``{"startup": row, "throughput": rows,
    "profile": ...}`` (``budget_s``: wall seconds this config may start parts within)."""
    from replayssm import LLM, SamplingParams
    from replayssm.bench import e2e
    from replayssm.distributed import TensorParallelGroup
    from replayssm.engine.loading import load

    t_begin = time.perf_counter()

    def left() -> float:
        return budget_s - (time.perf_counter() - t_begin)

    tp, control, method, fused, *how = config
    dev = "cuda:0"
    args = argparse.Namespace(device=dev, dtype="bfloat16", buffer_size=16, cuda_graphs=True, max_tokens=64,
                              prompt_len=32, spec_method=None, oracle_accept=1.0, max_seq_len=128, model=None,
                              ssm_state_dtype="auto")
    out = {"throughput": [], "startup": None, "profile": None}
    os.environ["REPLAYSSM_TP_ALLREDUCE"] = method
    os.environ["REPLAYSSM_TP_CONTROL"] = control
    os.environ["REPLAYSSM_TP_FUSED"] = fused      # workers inherit it when the group starts
    for k, v in zip(("REPLAYSSM_TP_FUSED_METHOD", "REPLAYSSM_TP_FUSED_MAX_ROWS"), (how + [None, None])[:2]):
        if v is None:
            os.environ.pop(k, None)               # the default
        else:
            os.environ[k] = v
    t = time.perf_counter()
    group_s = 0.0
    if tp == 1:
        model = load(path, torch.device(dev), torch.bfloat16, 1)[0]
    else:
        group = TensorParallelGroup(tp, dev)
        group_s = time.perf_counter() - t
        model = group.load_model(path, "bfloat16")
        model.owns_group = True
    load_s = time.perf_counter() - t
    if tp > 1:
        fin = model.local.tp_fused
        fz = "fused" if fin is not None and fin.ok else ("fused-off" if fin is None else "fused-ref")
        if fin is not None and fin.ok and how:
            fz = f"{getattr(fin, 'method', 'pull')}<={fin.fused_rows}"
        used = f"{control}+{model.local.tp.allreduce.method}+{fz}"
    else:
        used = "-"
    row = {"tp": tp, "method": used, "fused": fused, "load_s": load_s, "group_start_s": group_s}
    if tp > 1 and fin is not None and not fin.ok:
        row["fused_why_not"] = fin.why_not
        print(f"fused finish unavailable: {fin.why_not}", flush=True)
    out["startup"] = row
    print(f"[{_elapsed():.0f}s] TP={tp} {used}: loaded in {load_s:.1f} s (group start {group_s:.1f} s)",
          flush=True)
    if tp > 1:   # every rank's phases (scripts/gpu_tp_startup.py compares them with TP=1)
        from replayssm.distributed.startup import format_times

        row["phases"] = group.startup_times
        print(format_times(row["phases"]), flush=True)
    for mode in modes:
        for b in batches:
            if left() < 0:
                out["skipped_from"] = [mode, b]
                break
            r = e2e._run(LLM, SamplingParams, model, args, b, mode)
            r.update(tensor_parallel_size=tp, allreduce=used, fused=fused, load_s=load_s,
                     graph_ms=_graph_ms(LLM, SamplingParams, model, dev, b, mode))
            out["throughput"].append(r)
            print(f"[{_elapsed():.0f}s] TP={tp} {used} {mode} B={b}: {r['decode_tokens_per_s']:.0f} tok/s "
                  f"= {1e3 * b / r['decode_tokens_per_s']:.2f} ms/step, graph alone {r['graph_ms']:.2f} ms "
                  f"(capture {r['capture_s']:.1f} s)", flush=True)
    if profile and left() > 0:   # TP=2's table, and TP=1's to compare kernel by kernel
        out["profile"] = _profile(LLM, SamplingParams, model, dev, profile_batch)
        if tp == 1:
            print(f"TP=1 profile (B={profile_batch}):")
        _print_profile(out["profile"])
    if tp > 1:
        # close() is bounded; a teardown it gives up leaves torch.distributed initialised in
        # this process, which ends right after sending the result (no next group starts here)
        try:
            _close_with_watchdog(model, f"TP={tp} {used}")
        except SystemExit:
            out["close"] = "still running after 60 s (stacks printed)"
    return out


def e2e_rows(budget_s: float, batches, modes, configs=CONFIGS, profile: bool = True,
             profile_batch: int = 64) -> dict:
    """Every config in its own process (one result back each), the checkpoint written once."""
    from replayssm.bench import e2e
    from replayssm.bench.isolated import run_isolated

    out = {"throughput": [], "startup": [], "profile": None, "errors": []}
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        path = e2e._random_model_dir("2.7b", tmp)
        out["write_checkpoint_s"] = time.perf_counter() - t
        print(f"[{_elapsed():.0f}s] checkpoint written in {out['write_checkpoint_s']:.0f} s", flush=True)
        for config in configs:
            left = budget_s - _elapsed()
            if left <= 0:
                out["skipped_from"] = list(config)
                break
            tp, control, method = config[:3]
            key = "profile" if tp == 2 else "profile_tp1"
            want_profile = profile and out.get(key) is None and (tp == 1 or (control == "shm" and method == "auto"))
            # a config past the budget still finishes the part it started: kill only a stuck one
            r = run_isolated(_one_config, path, tuple(config), list(batches), list(modes), left, want_profile,
                             profile_batch, timeout_s=left + 300)
            if "error" in r:
                print(f"[{_elapsed():.0f}s] config {':'.join(map(str, config))} failed: {r['error']}", flush=True)
                out["errors"].append({"config": list(config), "error": r["error"]})
                continue
            print("CONFIG " + json.dumps({"config": list(config), "startup": r["startup"],
                                          "throughput": r["throughput"]}, default=str), flush=True)
            out["startup"].append(r["startup"])
            out["throughput"] += r["throughput"]
            if r.get("profile") is not None:
                out[key] = r["profile"]
            if "skipped_from" in r:
                out.setdefault("skipped", []).append({"config": list(config), "from": r["skipped_from"]})
    return out


def _graph_ms(LLM, SamplingParams, model, dev, B: int, mode: str) -> float:
    """Device time of one decode step: the captured graph of batch ``B`` replayed back to back
    on every rank (no host work between), against which the engine's step time shows the
    host's share."""
    from replayssm.bench import e2e

    prompts = e2e._prompts(B, 32, int(model.config.vocab_size), seed=5)
    with LLM(model, device=dev, decode_mode=mode, max_num_seqs=B, cuda_graphs=True, max_seq_len=128) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        return float(llm.runner.replay_ms(B, 20))


def _profile(LLM, SamplingParams, model, dev, B: int = 64, replays: int = 10) -> dict:
    """Profiler tables of ``replays`` back-to-back replays of the captured decode graph at
    batch ``B`` (``runner.replay_ms``: the step's kernels only, no prefill, no host work),
    every kernel's time per step in µs (``kernels``, top 40), plus the CUDA / host-op tables
    of a short greedy generate (``cuda``, ``cpu_self``, top 15: what the host does per step)."""
    from torch.profiler import ProfilerActivity, profile

    from replayssm.bench import e2e
    from replayssm.bench.common import graph_kernels

    prompts = e2e._prompts(B, 32, int(model.config.vocab_size), seed=3)
    with LLM(model, device=dev, decode_mode="replay", max_num_seqs=B, cuda_graphs=True, max_seq_len=128) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        gk = graph_kernels(llm, B, replays)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
            torch.cuda.synchronize()
    ka = prof.key_averages()
    cuda = sorted(ka, key=lambda e: -getattr(e, "device_time_total", 0))[:15]
    cpu = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:15]
    return {"kernels": [(k[:80], us, n) for k, us, n in gk[:40]],
            "kernels_total_us": sum(us for _, us, _ in gk),
            "cuda": [(e.key[:80], getattr(e, "device_time_total", 0) / 1e3, e.count) for e in cuda],
            "cpu_self": [(e.key[:80], e.self_cpu_time_total / 1e3, e.count) for e in cpu]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=480)
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--modes", default="replay,recurrent")
    p.add_argument("--skip-micro", action="store_true")
    p.add_argument("--configs", default=",".join(":".join(map(str, c)) for c in CONFIGS),
                   help="TP:control:allreduce[:fused[:rows]] entries (fused: REPLAYSSM_TP_FUSED 0 or 1, "
                        "default 1, or a REPLAYSSM_TP_FUSED_METHOD: pull, pull-b16, push, twoshot; rows: "
                        "REPLAYSSM_TP_FUSED_MAX_ROWS), e.g. 1:gloo:nccl,2:shm:auto:0,2:shm:auto:1,2:shm:auto:push:1024")
    p.add_argument("--skip-profile", action="store_true", help="no profiler table of a TP=2 config")
    p.add_argument("--profile-batch", type=int, default=64, help="the profiled TP=2 config's batch")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = p.parse_args()
    res = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
           "date": datetime.date.today().isoformat()}
    if not a.skip_micro:
        res["micro"] = micro()
        m = res["micro"]
        for r in m.get("allreduce", []):
            print(f"  {r.get('asked')}->{r.get('method')} {r.get('shape')} {r.get('dtype')}: "
                  f"{r.get('us_per_allreduce', float('nan')):.1f} us  err {r.get('max_err')}  {r.get('error', '')}")
        print("control message:", m.get("control_msg_us"), flush=True)
    configs = []
    for e in a.configs.split(","):
        f = e.split(":")
        methods = ("pull", "pull-b16", "push", "twoshot")
        if len(f) not in (3, 4, 5) or (len(f) >= 4 and f[3] not in ("0", "1") + methods) or \
                (len(f) == 5 and (f[3] not in methods or not f[4].isdigit())):
            p.error(f"bad config {e!r}: TP:control:allreduce[:0|1|method[:max rows]]")
        if len(f) >= 4 and f[3] in methods:
            configs.append((int(f[0]), f[1], f[2], "1", *f[3:]))
        else:
            configs.append((int(f[0]), f[1], f[2], f[3] if len(f) == 4 else "1"))
    res.update(e2e_rows(a.budget_s, [int(b) for b in a.batches.split(",")], a.modes.split(","), configs,
                        profile=not a.skip_profile, profile_batch=a.profile_batch))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "profile_tp.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print("startup:", res["startup"])
    base = {(r["mode"], r["batch"]): r["decode_tokens_per_s"] for r in res["throughput"]
            if r["tensor_parallel_size"] == 1}
    print(f"{'mode':<10}{'B':>5}{'config':>24}{'tok/s':>9}{'÷ TP=1':>8}{'ms/step':>9}{'graph ms':>10}")
    for r in res["throughput"]:
        b = base.get((r["mode"], r["batch"]))
        print(f"{r['mode']:<10}{r['batch']:>5}{r['allreduce'] if r['tensor_parallel_size'] > 1 else 'TP=1':>24}"
              f"{r['decode_tokens_per_s']:>9.0f}{(r['decode_tokens_per_s'] / b if b else float('nan')):>7.2f}x"
              f"{1e3 * r['batch'] / r['decode_tokens_per_s']:>9.2f}{r['graph_ms']:>10.2f}")
    for e in res.get("errors", []):
        print(f"config {':'.join(map(str, e['config']))} FAILED (see its traceback above)")
    print(f"total {_elapsed():.0f} s")
    return 1 if res.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
