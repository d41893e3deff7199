"""``replayssm bench mtp``: MTP drafting against the draft model and n-gram, on GPU.

Random-weight models accept nothing real, so every speculative run here verifies the
*oracle's* tokens (each request's known greedy continuation, each draft kept with probability
``--oracle-accept``): the verify side is identical across drafters, and each drafter still
does all of its own work every step (its proposal is computed, then replaced).  Measured per
batch size, in one process, replay form with CUDA graphs:

* **drafting cost per step**: wall time from the start of ``propose`` to the completion of its
  last kernel (CUDA events; the GPU is idle when a step starts, so this is the host's launch
  work plus the device time), plus the drafter's ``accepted`` bookkeeping, per step;
* **end-to-end decode tokens/s** without speculation and with each drafter, and the mean
  accepted length (the oracle's, the same for all drafters);
* the length policy (``SpeculativeConfig``'s default, ``"adaptive"``) and the draft lengths it
  chose (``T=0`` steps decode plainly; drafting cost is per speculative step).

The MTP head gets random weights in the target's own MTP layout (:func:`add_random_mtp`);
the draft model is a random Mamba-2 sharing the target's vocabulary (``--draft-*``).
Writes ``mtp_bench.json`` (after every row) and prints a table.  ``--smoke`` runs the
preset's tiny variant on the CPU (B=1,2 unless ``--batch-sizes`` is given, 8 tokens, eager):
a check that every path runs, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..argtypes import int_list, positive_int, probability
from ..engine.config import SamplingParams, SpeculativeConfig
from ..engine.llm import LLM
from ..models import load_model
from . import e2e
from .common import free_memory, private_copy, warm_then_time
from .e2e import OracleDrafter, OracleTokens, _prompts
from .hybrid_presets import TINY_OF
from .random_mtp import add_random_mtp


class TimedDrafter:
    """Times ``propose`` + ``accepted`` of a drafter per step: CUDA events (start of the
    call to the completion of its kernels) and host wall time."""

    def __init__(self, inner, cuda: bool):
        self.inner, self.cuda = inner, cuda
        self.method = getattr(inner, "method", "?")
        self.runner = getattr(inner, "runner", None)
        self.events, self.host_s, self.steps = [], 0.0, 0

    def clear_timings(self):
        self.events, self.host_s, self.steps = [], 0.0, 0

    def _timed(self, fn, *a):
        e0 = e1 = None
        if self.cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        r = fn(*a)
        self.host_s += time.perf_counter() - t0
        if self.cuda:
            e1.record()
            self.events.append((e0, e1))
        return r

    def prefill(self, seqs):
        self.inner.prefill(seqs)

    def propose(self, seqs, k=None):
        self.steps += 1
        return self._timed(self.inner.propose, seqs, k)

    def plain_step(self, seqs):
        self.inner.plain_step(seqs)

    def accepted(self, seqs, accepted, path):
        self._timed(self.inner.accepted, seqs, accepted, path)

    def release(self, seq):
        self.inner.release(seq)

    def reset(self):   # the engine's recover(): forget a half-done draft step
        getattr(self.inner, "reset", lambda: None)()

    def per_step_ms(self) -> tuple[float, float]:
        """(device-inclusive ms, host ms) per step."""
        if self.cuda:
            torch.cuda.synchronize()
            dev = sum(a.elapsed_time(b) for a, b in self.events)
        else:
            dev = self.host_s * 1e3
        n = max(1, self.steps)
        return dev / n, self.host_s * 1e3 / n


def _draft_dir(vocab: int, root: str, hidden: int, layers: int) -> str:
    """A random Mamba-2 draft model with the target's vocabulary (e2e's recipe)."""
    name = f"mtp-bench-draft-{vocab}-{hidden}x{layers}"
    e2e.PRESETS.setdefault(name, dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                      num_heads=2 * hidden // 64, head_dim=64, state_size=128, n_groups=1,
                                      expand=2, conv_kernel=4))
    return e2e._random_model_dir(name, root)


def _run(args, target, draft, method: str | None, batch: int, refs_cache: dict) -> dict:
    vocab = int(target.config.vocab_size)
    prompts = _prompts(batch, args.prompt_len, vocab, seed=batch)
    warm = [p[:-1] + [(p[-1] + 1) % vocab] for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    if method is not None and batch not in refs_cache:  # the oracle's continuations, once per batch
        ref = LLM(target, device=args.device, dtype=args.dtype, decode_mode="recurrent", max_num_seqs=batch,
                  max_seq_len=args.max_seq_len)
        refs = {tuple(p): o.token_ids for p, o in zip(prompts + warm, ref.generate(prompts + warm, params))}
        refs_cache[batch] = refs
        del ref
        free_memory(args.device)
    spec = None
    if method is not None:
        spec = SpeculativeConfig(method, num_tokens=args.num_tokens,
                                 draft_model=draft if method == "draft" else None)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    llm = LLM(target, device=args.device, dtype=args.dtype, decode_mode=args.mode, buffer_size=args.buffer_size,
              speculative=spec, max_num_seqs=batch, cuda_graphs=args.cuda_graphs, max_seq_len=args.max_seq_len)
    timer = None
    if method is not None:
        oracle = OracleDrafter(refs_cache[batch], args.num_tokens, args.oracle_accept, vocab, llm.device)
        timer = llm.drafter = TimedDrafter(OracleTokens(llm.drafter, oracle), cuda)
    outs, wall = warm_then_time(llm, warm, prompts, params, args.device,
                                on_warm=None if timer is None else timer.clear_timings)
    gen = sum(len(o.token_ids) for o in outs)
    row = {"batch": batch, "drafter": method or "none", "tokens_per_s": gen / wall,
           "decode_tokens_per_s": (gen - len(outs)) / max(llm.stats["decode_s"], 1e-9),
           "mean_accepted_length": sum(o.mean_accepted_length for o in outs) / len(outs),
           "steps": llm.stats["steps"], "capture_s": llm.capture_s,
           "peak_memory_GB": torch.cuda.max_memory_allocated() / 1e9 if cuda else None}
    if timer is not None:
        row["draft_ms_per_step"], row["draft_host_ms_per_step"] = timer.per_step_ms()
        row["draft_steps"] = timer.steps
        row["spec_policy"] = spec.spec_policy                  # "adaptive": T (0 included) per step
        row["draft_lengths"] = e2e.draft_length_steps(llm.stats)
    del llm
    free_memory(args.device)
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replayssm bench mtp", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-next-4b", help="a bench e2e preset (random weights)")
    p.add_argument("--model", default=None, help="a model directory instead of --preset (given an MTP head "
                                                  "when it has none)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--mode", default="replay")
    p.add_argument("--batch-sizes", type=int_list, default="1,16,64,256")
    p.add_argument("--drafters", default="none,ngram,draft,mtp")
    p.add_argument("--num-tokens", type=positive_int, default=4)
    p.add_argument("--oracle-accept", type=probability, default=0.7)
    p.add_argument("--max-tokens", type=positive_int, default=48)
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--buffer-size", type=positive_int, default=16)
    p.add_argument("--draft-hidden", type=positive_int, default=512)
    p.add_argument("--draft-layers", type=positive_int, default=8)
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--out", default="out/bench_mtp")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (the preset's tiny variant, B=1,2, "
                                                         "eager) for CI")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:   # a tiny CPU run; --batch-sizes / --drafters given explicitly still apply
        args.device = args.device or "cpu"
        args.preset = TINY_OF.get(args.preset, args.preset)
        if args.batch_sizes == parser.get_default("batch_sizes"):
            args.batch_sizes = "1,2"
        args.max_tokens, args.prompt_len = 8, 12
        args.draft_hidden, args.draft_layers, args.cuda_graphs = 64, 2, False
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda":
        args.device = f"cuda:{torch.cuda.current_device()}"
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.max_seq_len = -(-(args.prompt_len + args.max_tokens + 2 * (args.num_tokens + 1) + 16) // 64) * 64
    args.buffer_size = max(args.buffer_size, 2 * (args.num_tokens + 1))
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    drafters = [None if d == "none" else d for d in args.drafters.split(",") if d]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"config": vars(args), "rows": []}
    dt = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            src = args.model
            if not os.path.isfile(os.path.join(src, "mtp.safetensors")):
                src = shutil.copytree(args.model, os.path.join(tmp, "model"))
                add_random_mtp(src)
        else:
            try:
                src = e2e._random_model_dir(args.preset, tmp)
            except KeyError:
                print(f"unknown preset {args.preset!r}", file=sys.stderr)
                return 2
            src = private_copy(src, os.path.join(tmp, "target"))   # the head is written into it
            add_random_mtp(src)
        target = load_model(src, device=args.device, dtype=dt, mtp=True)
        draft = None
        if "draft" in drafters:
            draft = load_model(_draft_dir(int(target.config.vocab_size), tmp, args.draft_hidden, args.draft_layers),
                               device=args.device, dtype=dt)
        res["config"]["device_name"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        res["config"]["target_params"] = sum(p.numel() for p in target.parameters() if not p.is_meta)
        res["config"]["mtp_params"] = sum(p.numel() for p in target.mtp.parameters())
        res["config"]["draft_params"] = sum(p.numel() for p in draft.parameters()) if draft is not None else None
        refs: dict = {}
        for b in batches:
            for m in drafters:
                row = _run(args, target, draft, m, b, refs)
                res["rows"].append(row)
                (out / "mtp_bench.json").write_text(json.dumps(res, indent=1, default=str))
                print(f"[bench mtp] B={b} {row['drafter']}: {row['decode_tokens_per_s']:.0f} decode tok/s, acc "
                      f"{row['mean_accepted_length']:.2f}, draft {row.get('draft_ms_per_step', 0):.3f} ms/step",
                      file=sys.stderr, flush=True)
    c = res["config"]
    print(f"target {args.model or args.preset} ({c['target_params'] / 1e9:.2f} B params, MTP head "
          f"{c['mtp_params'] / 1e6:.0f} M, draft {(c['draft_params'] or 0) / 1e6:.0f} M); {c['device_name']}; "
          f"{args.dtype}; mode {args.mode}; T={args.num_tokens}; oracle acceptance {args.oracle_accept}")
    print(f"{'batch':>6} {'drafter':<8}{'draft ms/step':>14}{'host ms':>9}{'decode tok/s':>14}{'vs none':>9}{'acc':>6}"
          f"  policy: chosen T")
    base = {r["batch"]: r["decode_tokens_per_s"] for r in res["rows"] if r["drafter"] == "none"}
    for r in res["rows"]:
        rel = r["decode_tokens_per_s"] / base[r["batch"]] if r["batch"] in base else float("nan")
        print(f"{r['batch']:>6} {r['drafter']:<8}{r.get('draft_ms_per_step', 0):>14.3f}"
              f"{r.get('draft_host_ms_per_step', 0):>9.3f}{r['decode_tokens_per_s']:>14.0f}{rel:>9.2f}"
              f"{r['mean_accepted_length']:>6.2f}  "
              + (f"{r['spec_policy']}: {e2e.format_lengths(r['draft_lengths'])}" if "spec_policy" in r else "-"))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
