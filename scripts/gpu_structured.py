"""The cost of structured outputs on one GPU: constrained vs free decoding, and constrained
speculative vs constrained plain decoding, at several batch sizes, with a per-step breakdown
of the host's grammar time.

On a random-weight model of a bench preset (default the 2.7B Mamba-2; a hybrid with
``--preset``), in replay mode with CUDA graphs, for each ``B`` in ``--batches`` (default 1 16
64): ``B`` requests of ``--max-tokens`` tokens, all submitted at once:

* ``free``: plain decoding, no constraint (``ignore_eos``);
* ``json``: plain decoding with a JSON schema on every row (llguidance masks every step;
  random weights never write JSON, so the mask decides every token — the cost is what is
  measured).  The schema's long ``text`` field keeps every row generating to the end;
* ``free+spec`` / ``json+spec``: the same with speculation (``--num-tokens`` drafts per
  step, ``spec_policy`` ``--policy``); drafts come from an oracle drafter (each request's
  known plain output of the same kind, each draft corrupted with probability 1 -
  ``--accept``: a corrupted draft in a constrained row is mostly cut by the grammar), as
  ``gpu_spec_policy.py`` does: real drafters find nothing on random weights.

The tokenizer is a synthetic byte-level BPE over the model's whole vocabulary (printable
pairs, then 3- and 4-character strings of JSON's characters; no tokenizer ships with random
weights), so llguidance's token trie has the model's size.

Checks: every constrained output is accepted by a fresh matcher of the schema (``valid``),
and speculative outputs are compared with plain ones of the same kind (``mismatch``: bf16
verify and decode logits can differ on near-ties between allowed tokens, which random weights
make common under a mask; exactness is tested on CPU in tests/engine/test_structured_spec.py).

``free-again``: free decoding once more after the json runs, at the largest batch (a
control: a slowdown from running after the json runs, rather than from the grammar, shows
here).

Per run, per engine step (``steps``: prefill and decode steps): the wall time, the
executor's decode time (launch, wait, mask, sample, the host sync) and the grammar's host
time from the engine stats: ``fill`` (llguidance's parallel fill, on the worker thread,
overlapping the forward), ``wait`` (the step waiting for the fill after launching the
forward: the part not hidden), ``apply`` (queuing the mask's device ops), ``walk`` (the draft
walk of a speculative step, before its verify is launched) and ``advance`` (feeding the
sampled tokens to the matchers).  ``host grammar`` = wait + apply + walk + advance is what
the step's critical path pays on the host.

``llguidance alone``: the cost of the grammar work on this host outside the engine (one
fresh matcher per json output of the largest batch, walked along it: the parallel fill per
step, the same on one thread, and the advance), to compare with the step time.

Prints the tokens/s table, the breakdown and the ratios json / free (target >= 0.90 at the
largest batch) and json+spec / json per batch; writes ``structured.json`` to ``$OUT`` when
set.

Usage (GPU, about 3-4 minutes)::

    PYTHONPATH=. python scripts/gpu_structured.py
    PYTHONPATH=. python scripts/gpu_structured.py --preset nemotron-h-4b --policy adaptive

CPU smoke run: ``--device cpu --preset 130m --batches 1 4 --max-tokens 8 --prompt-len 8``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import string
import sys
import tempfile
import time

import torch

from replayssm.bench.common import free_memory, sync
from replayssm.bench.e2e import OracleDrafter, _prompts, _random_model_dir
from replayssm.engine.config import SamplingParams, SpeculativeConfig
from replayssm.engine.llm import LLM
from replayssm.engine.loading import load
from replayssm.engine.structured import require_llguidance

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
                         "text": {"type": "string", "minLength": 4000}},
          "required": ["id", "tags", "text"], "additionalProperties": False}


def synthetic_tokenizer(V: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``V`` ids (``V - 1``: ``<eos>``): the 256
    bytes, printable pairs, then 3- and 4-character strings of letters, digits and JSON's
    punctuation (each merge: a token's prefix + its last character)."""
    from tokenizers import Tokenizer
    if V < 258:
        raise ValueError(f"synthetic_tokenizer: the model's vocabulary ({V}) must hold the 256 bytes, <eos> "
                         f"and more")
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = list(bs)
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    b2u = {b: chr(c) for b, c in zip(bs, cs)}   # GPT-2's byte -> printable character map
    vocab, merges = {}, []
    for b in range(256):
        vocab[b2u[b]] = len(vocab)
    printable = [b2u[b] for b in range(32, 127)]
    letters = [b2u[ord(c)] for c in string.ascii_lowercase + string.digits + ' "{}[]:,.']
    for n, alphabet in ((2, printable), (3, letters), (4, letters)):
        for tup in itertools.product(alphabet, repeat=n):
            if len(vocab) >= V - 1:
                break
            t = "".join(tup)
            if t not in vocab:
                vocab[t] = len(vocab)
                merges.append([t[:-1], t[-1]])
    while len(vocab) < V - 1:
        vocab[f"<unused{len(vocab)}>"] = len(vocab)
    vocab["<eos>"] = V - 1
    eos = {"id": V - 1, "content": "<eos>", "single_word": False, "lstrip": False, "rstrip": False,
           "normalized": False, "special": True}
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    js = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [eos], "normalizer": None,
          "pre_tokenizer": bl, "post_processor": None, "decoder": bl,
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                    "vocab": vocab, "merges": merges}}
    return Tokenizer.from_str(json.dumps(js))


GRAMMAR = ("fill", "wait", "apply", "walk", "advance")


def _timed(llm, prompts, params, args) -> tuple[list, float, dict]:
    """The fastest of ``--repeats`` runs, after a short run of the same kind (graphs of the
    masked verify steps are captured when first met); the engine stats of that run."""
    warm = SamplingParams(**{**params.__dict__, "max_tokens": 8})
    llm.generate(prompts, warm)
    best = None
    for _ in range(args.repeats):
        for k in llm.stats:
            llm.stats[k] = 0 if isinstance(llm.stats[k], int) else 0.0
        sync(args.device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync(args.device)
        wall = time.perf_counter() - t0
        if best is None or wall < best[1]:
            best = (outs, wall, dict(llm.stats))
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="2.7b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--num-tokens", type=int, default=3)
    p.add_argument("--accept", type=float, default=0.8)
    p.add_argument("--policy", default="fixed", choices=("fixed", "adaptive"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    if min(args.batches) < 1:
        raise ValueError(f"--batches must be >= 1, got {args.batches}")
    args.batches = sorted(set(args.batches))
    t_start = time.perf_counter()
    dev_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    tmp = tempfile.mkdtemp(prefix="structured-")   # kept until the end (weights may be read lazily)
    try:
        return _run(args, tmp, t_start, dev_name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tps(run) -> float:
    outs, wall, _ = run
    return sum(len(o.token_ids) for o in outs) / wall


def _breakdown(wall: float, stats: dict) -> dict:
    """Milliseconds per engine step: wall, the executor's decode part, the grammar parts."""
    n = max(1, stats.get("steps", 0))
    row = {"steps": stats.get("steps", 0), "step_ms": 1e3 * wall / n, "decode_ms": 1e3 * stats.get("decode_s", 0.0) / n}
    for g in GRAMMAR:
        row[g + "_ms"] = 1e3 * stats.get(f"grammar_{g}_s", 0.0) / n
    row["host_grammar_ms"] = sum(row[g + "_ms"] for g in GRAMMAR if g != "fill")
    return row


def _fill_probe(grammars, outs) -> dict:
    """llguidance on this host, outside the engine: one fresh matcher per output walked along
    it; per step (all rows) the parallel fill (the engine's executor), the same with one
    thread, and the advance, in ms (median, mean, max over the steps)."""
    import statistics

    from replayssm.engine.structured.logits import fill_bitmask
    llg = require_llguidance()
    T = min(len(o.token_ids) for o in outs)
    res = {"rows": len(outs), "steps": T, "cpus": len(os.sched_getaffinity(0))}
    for name, ex in (("fill_par", llg.LLExecutor()), ("fill_1thread", llg.LLExecutor(num_threads=1))):
        ms = [grammars.matcher({"json": SCHEMA}) for _ in outs]
        buf = torch.empty(len(outs), (grammars.ll.vocab_size + 31) // 32, dtype=torch.int32)
        fills, adv = [], []
        for i in range(T):
            t0 = time.perf_counter()
            fill_bitmask(ex, [(m, b) for b, m in enumerate(ms)], buf)
            t1 = time.perf_counter()
            for m, o in zip(ms, outs):
                m.consume_token(o.token_ids[i])
                m.is_stopped()
            fills.append(1e3 * (t1 - t0))
            adv.append(1e3 * (time.perf_counter() - t1))
        res[name] = {"median": statistics.median(fills), "mean": statistics.mean(fills), "max": max(fills)}
        res["advance"] = {"median": statistics.median(adv), "mean": statistics.mean(adv), "max": max(adv)}
    return res


def _run(args, tmp: str, t_start: float, dev_name: str) -> int:
    model = load(_random_model_dir(args.preset, tmp), torch.device(args.device), getattr(torch, args.dtype))[0]
    V = int(model.config.vocab_size)
    model.config = dataclasses.replace(model.config, eos_token_id=V - 1)   # the synthetic tokenizer's <eos>
    tok = synthetic_tokenizer(V)
    Bmax = max(args.batches)
    prompts = _prompts(Bmax, args.prompt_len, V - 1, seed=0)
    kinds = {"free": SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
             "json": SamplingParams(max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA})}
    kw = dict(device=args.device, dtype=args.dtype, decode_mode="replay", max_num_seqs=Bmax,
              max_seq_len=args.prompt_len + args.max_tokens + 16, tokenizer=tok,
              buffer_size=max(16, 2 * (args.num_tokens + 1)))
    runs = {}   # (kind, B) -> (outputs, wall, stats)

    def log(name, B):
        print(f"[structured] B={B:<3} {name:<10} {_tps(runs[(name, B)]):>9.0f} tok/s "
              f"({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)

    llm = LLM(model, **kw)
    for B in args.batches:
        for k, sp in kinds.items():
            runs[(k, B)] = _timed(llm, prompts[:B], sp, args)
            log(k, B)
    # control: free decoding again after the json runs (llguidance loaded, matchers freed): an
    # order effect would show here instead of in the grammar's breakdown
    runs[("free-again", Bmax)] = _timed(llm, prompts[:Bmax], kinds["free"], args)
    log("free-again", Bmax)
    grammars = llm.constraints.grammars
    probe = _fill_probe(grammars, runs[("json", Bmax)][0])
    del llm
    free_memory(args.device)
    spec = SpeculativeConfig("ngram", num_tokens=args.num_tokens, spec_policy=args.policy)
    llm = LLM(model, speculative=spec, **kw)
    for B in args.batches:
        for k, sp in kinds.items():
            refs = {tuple(q): o.token_ids for q, o in zip(prompts[:B], runs[(k, B)][0])}
            llm.drafter = OracleDrafter(refs, args.num_tokens, args.accept, V - 1, llm.device)
            runs[(k + "+spec", B)] = _timed(llm, prompts[:B], sp, args)
            log(k + "+spec", B)
    del llm
    free_memory(args.device)

    res = {"device": dev_name, "config": vars(args), "runs": {}, "ratios": {}, "fill_probe": probe}
    for (name, B), (outs, wall, stats) in runs.items():
        gen = sum(len(o.token_ids) for o in outs)
        row = {"kind": name, "batch": B, "tokens_per_s": gen / wall, "wall_s": wall, "generated": gen,
               "mean_accepted_length": sum(o.mean_accepted_length for o in outs) / len(outs),
               "drafted": sum(o.num_drafted for o in outs), "accepted": sum(o.num_accepted for o in outs)}
        base = runs[(name.split("+")[0].replace("-again", ""), B)][0]
        row["mismatch"] = sum(a.token_ids != b.token_ids for a, b in zip(outs, base))
        if name.startswith("json"):
            row["valid"] = sum(grammars.matcher({"json": SCHEMA}).validate_tokens(o.token_ids) == len(o.token_ids)
                               for o in outs)
        row["per_step"] = _breakdown(wall, stats)
        res["runs"][f"{name}@{B}"] = row
    r = res["runs"]
    for B in args.batches:
        def t(k, B=B):
            return r[f"{k}@{B}"]["tokens_per_s"]
        res["ratios"][str(B)] = {"json / free": t("json") / t("free"), "json+spec / json": t("json+spec") / t("json"),
                                 "free+spec / free": t("free+spec") / t("free"),
                                 "json+spec / free+spec": t("json+spec") / t("free+spec")}
    res["ratios"][str(Bmax)]["free-again / free"] = t_again = \
        r[f"free-again@{Bmax}"]["tokens_per_s"] / r[f"free@{Bmax}"]["tokens_per_s"]
    res["elapsed_s"] = time.perf_counter() - t_start
    print(f"\n== structured outputs: {args.preset} ({args.dtype}), {dev_name}, {args.max_tokens} tokens, replay, "
          f"CUDA graphs, spec ngram/{args.policy} k={args.num_tokens} (oracle drafts, accept {args.accept})")
    print(f"{'run':<15} {'tok/s':>8} {'gen':>6} {'acc.len':>7} {'mism':>5} {'valid':>5} | per step ms: {'steps':>5} "
          f"{'step':>6} {'decode':>6} {'fill':>6} {'wait':>6} {'apply':>6} {'walk':>6} {'advance':>7} {'host gr':>7}")
    for key, row in r.items():
        b = row["per_step"]
        print(f"{key:<15} {row['tokens_per_s']:>8.0f} {row['generated']:>6} {row['mean_accepted_length']:>7.2f} "
              f"{row['mismatch']:>5} "
              f"{row.get('valid', '-'):>5} |               {b['steps']:>5} {b['step_ms']:>6.2f} {b['decode_ms']:>6.2f} "
              f"{b['fill_ms']:>6.3f} {b['wait_ms']:>6.3f} {b['apply_ms']:>6.3f} {b['walk_ms']:>6.3f} "
              f"{b['advance_ms']:>7.3f} {b['host_grammar_ms']:>7.3f}")
    print(f"\n{'B':>4} {'json/free':>10} {'json+spec/json':>15} {'free+spec/free':>15} {'json+spec/free+spec':>20}")
    for B in args.batches:
        q = res["ratios"][str(B)]
        print(f"{B:>4} {q['json / free']:>10.3f} {q['json+spec / json']:>15.3f} {q['free+spec / free']:>15.3f} "
              f"{q['json+spec / free+spec']:>20.3f}")
    print(f"free-again / free at B={Bmax} (free decoding after the json runs: an order effect) {t_again:.3f}")
    print(f"\nllguidance alone ({probe['rows']} rows along the json@{Bmax} outputs, {probe['steps']} steps, "
          f"{probe['cpus']} CPUs), ms per step median / mean / max:")
    for k in ("fill_par", "fill_1thread", "advance"):
        q = probe[k]
        print(f"  {k:<13} {q['median']:>8.3f} {q['mean']:>8.3f} {q['max']:>8.3f}")
    fails = []
    top = res["ratios"][str(Bmax)]["json / free"]
    if top < 0.90:
        fails.append(f"json / free at B={Bmax} = {top:.3f} < 0.90")
    for key, row in r.items():
        if "valid" in row and row["valid"] != row["batch"]:
            fails.append(f"{key}: {row['batch'] - row['valid']} outputs the schema rejects")
    print(f"elapsed {res['elapsed_s']:.0f} s; " + ("; ".join(fails) if fails else "all checks passed"))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "structured.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
