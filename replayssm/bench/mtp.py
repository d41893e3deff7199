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
  accepted length (the oracle's, the same for all drafters).

The MTP head gets random weights in the target's own MTP layout (:func:`add_random_mtp`);
the draft model is a random Mamba-2 sharing the target's vocabulary (``--draft-*``).
Writes ``mtp_bench.json`` (after every row) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def add_random_mtp(model_dir: str, seed: int = 0) -> str:
    """Give the HF model in ``model_dir`` a random MTP head in its checkpoint layout
    (``mtp.safetensors`` + the config keys that declare it), in the checkpoint's dtype.
    Names and shapes come from :class:`replayssm.models.mtp.MTPHead` on the ``meta`` device.
    Nemotron-H gets one ``*E`` step when the target has MoE layers, else ``*-``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from replayssm.layers.norms import GatedRMSNorm, RMSNorm
    from replayssm.models.config import read_config
    from replayssm.models.loader import _model_class
    from replayssm.models.mtp import MTPHead

    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    if cfg["model_type"] == "nemotron_h":
        moe = "E" in cfg.get("hybrid_override_pattern", "") or "moe" in cfg.get("layers_block_type", [])
        cfg["mtp_hybrid_override_pattern"] = "*E" if moe else "*-"
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors") and f != "mtp.safetensors")
    with safe_open(str(d / files[0]), "pt") as f:
        dtype = f.get_tensor(next(iter(f.keys()))).dtype
    c = read_config(str(d))
    with torch.device("meta"):
        head = MTPHead(_model_class(c)(c, torch.float32, "cpu"), 1)
    g = torch.Generator().manual_seed(seed)
    L = max(1, len(head.blocks))
    out = {}
    for name, p in head.named_parameters():
        mod_name, _, leaf = name.rpartition(".")
        mod = head.get_submodule(mod_name)
        shape = tuple(p.shape)
        if isinstance(mod, RMSNorm):
            t = torch.zeros(shape) if mod.zero_centered else torch.ones(shape)
        elif isinstance(mod, GatedRMSNorm) or leaf == "D":
            t = torch.ones(shape)
        elif leaf == "A_log":
            t = torch.log(torch.empty(shape).uniform_(1, 16, generator=g))
        elif leaf == "dt_bias":
            t = torch.log(torch.expm1(torch.empty(shape).uniform_(1e-3, 1e-1, generator=g)))
        elif "conv1d" in name:
            t = torch.randn(shape, generator=g) * (0.3 if leaf == "weight" else 0.1)
        elif len(shape) == 1:
            t = torch.zeros(shape)
        else:
            scale = 0.02 / L ** 0.5 if any(k in name for k in ("o_proj", "out_proj", "down_proj")) else 0.02
            t = torch.randn(shape, generator=g) * scale
        out["mtp." + name] = t.to(dtype).contiguous()
    save_file(out, str(d / "mtp.safetensors"))
    return str(d)


class OracleTokens:
    """A drafter that does ``inner``'s work every step but proposes ``oracle``'s tokens."""

    def __init__(self, inner, oracle):
        self.inner, self.oracle = inner, oracle
        self.method = getattr(inner, "method", "?")
        self.runner = getattr(inner, "runner", None)

    def prefill(self, seqs):
        self.inner.prefill(seqs)

    def propose(self, seqs):
        self.inner.propose(seqs)
        return self.oracle.propose(seqs)

    def accepted(self, seqs, accepted, path):
        self.inner.accepted(seqs, accepted, path)

    def release(self, seq):
        self.inner.release(seq)


class TimedDrafter:
    """Times ``propose`` + ``accepted`` of a drafter per step: CUDA events (start of the
    call to the completion of its kernels) and host wall time."""

    def __init__(self, inner, cuda: bool):
        self.inner, self.cuda = inner, cuda
        self.method = getattr(inner, "method", "?")
        self.runner = getattr(inner, "runner", None)
        self.events, self.host_s, self.steps = [], 0.0, 0

    def reset(self):
        self.events, self.host_s, self.steps = [], 0.0, 0

    def _timed(self, fn, *a):
        import torch

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

    def propose(self, seqs):
        self.steps += 1
        return self._timed(self.inner.propose, seqs)

    def accepted(self, seqs, accepted, path):
        self._timed(self.inner.accepted, seqs, accepted, path)

    def release(self, seq):
        self.inner.release(seq)

    def per_step_ms(self) -> tuple[float, float]:
        """(device-inclusive ms, host ms) per step."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            dev = sum(a.elapsed_time(b) for a, b in self.events)
        else:
            dev = self.host_s * 1e3
        n = max(1, self.steps)
        return dev / n, self.host_s * 1e3 / n


def _draft_dir(vocab: int, root: str, hidden: int, layers: int) -> str:
    """A random Mamba-2 draft model with the target's vocabulary (e2e's recipe)."""
    from . import e2e

    name = f"mtp-bench-draft-{vocab}-{hidden}x{layers}"
    e2e.PRESETS.setdefault(name, dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                      num_heads=2 * hidden // 64, head_dim=64, state_size=128, n_groups=1,
                                      expand=2, conv_kernel=4))
    return e2e._random_model_dir(name, root)


def _run(args, target, draft, method: str | None, batch: int, refs_cache: dict) -> dict:
    import torch

    from replayssm.engine.config import SamplingParams, SpeculativeConfig
    from replayssm.engine.llm import LLM

    from .e2e import OracleDrafter, _free, _prompts, _sync

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
        _free(args.device)
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
    llm.generate(warm, SamplingParams(max_tokens=min(4, args.max_tokens), ignore_eos=True))
    for k in llm.stats:
        llm.stats[k] = 0 if isinstance(llm.stats[k], int) else 0.0
    if timer is not None:
        timer.reset()
    _sync(args.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(args.device)
    wall = time.perf_counter() - t0
    gen = sum(len(o.token_ids) for o in outs)
    row = {"batch": batch, "drafter": method or "none", "tokens_per_s": gen / wall,
           "decode_tokens_per_s": (gen - len(outs)) / max(llm.stats["decode_s"], 1e-9),
           "mean_accepted_length": sum(o.mean_accepted_length for o in outs) / len(outs),
           "steps": llm.stats["steps"], "capture_s": llm.capture_s,
           "peak_memory_GB": torch.cuda.max_memory_allocated() / 1e9 if cuda else None}
    if timer is not None:
        row["draft_ms_per_step"], row["draft_host_ms_per_step"] = timer.per_step_ms()
        row["draft_steps"] = timer.steps
    del llm
    _free(args.device)
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replayssm bench mtp", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-next-4b", help="a bench e2e preset (random weights)")
    p.add_argument("--model", default=None, help="a model directory instead of --preset (given an MTP head "
                                                  "when it has none)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--mode", default="replay")
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--drafters", default="none,ngram,draft,mtp")
    p.add_argument("--num-tokens", type=int, default=4)
    p.add_argument("--oracle-accept", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--buffer-size", type=int, default=16)
    p.add_argument("--draft-hidden", type=int, default=512)
    p.add_argument("--draft-layers", type=int, default=8)
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--out", default="out/bench_mtp")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from replayssm.models import load_model

    from . import e2e

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
                import shutil

                src = shutil.copytree(args.model, os.path.join(tmp, "model"))
                add_random_mtp(src)
        else:
            try:
                src = e2e._random_model_dir(args.preset, tmp)
            except KeyError:
                print(f"unknown preset {args.preset!r}", file=sys.stderr)
                return 2
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
    print(f"{'batch':>6} {'drafter':<8}{'draft ms/step':>14}{'host ms':>9}{'decode tok/s':>14}{'vs none':>9}{'acc':>6}")
    base = {r["batch"]: r["decode_tokens_per_s"] for r in res["rows"] if r["drafter"] == "none"}
    for r in res["rows"]:
        rel = r["decode_tokens_per_s"] / base[r["batch"]] if r["batch"] in base else float("nan")
        print(f"{r['batch']:>6} {r['drafter']:<8}{r.get('draft_ms_per_step', 0):>14.3f}"
              f"{r.get('draft_host_ms_per_step', 0):>9.3f}{r['decode_tokens_per_s']:>14.0f}{rel:>9.2f}"
              f"{r['mean_accepted_length']:>6.2f}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
