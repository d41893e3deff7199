"""``replayssm bench e2e``: end-to-end engine throughput.

Measures, on one model:

1. decode throughput vs batch size, recurrent vs replay (optionally kv / auto);
2. speculative decoding: the snapshot baseline (recurrent form, one state per draft) vs
   replay speculation (rollback is a pointer move), tokens/s and mean accepted length;
3. the most sequences that fit a memory budget in each form (with and without speculation),
   checked by running twice that many requests and recording the peak batch.

Writes ``e2e.json`` and ``e2e_*.png`` into ``--out``.  ``--smoke`` is a CPU run on a tiny
model that finishes in well under 30 s (CI).  Without ``--model`` the benchmark builds a
random-weight Mamba-2 of the ``--preset`` size with ``replayssm.models`` when available, and
falls back to the engine's recomputation reference model otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from array import array
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..argtypes import int_list, nonnegative_int, positive_float, positive_int, probability
from ..cache.spec import STATE_DTYPES
from ..engine.config import SamplingParams, SpeculativeConfig
from ..engine.llm import LLM
from ..engine.loading import load
from ..engine.spec import Proposal, chain_parent
from ..models.margin import branch_scale, permuted_head
from ..runtime import host_to_device
from . import prefix, ttft
from .common import draft_length_steps, free_memory, random_model_dir, warm_then_time
# hybrid presets (Nemotron-H-class, Qwen3-Next-class with MoE)
from .hybrid_presets import HYBRID_PRESETS, TINY_OF, preset_config, random_hybrid_dir
from .random_mtp import add_random_mtp

PRESETS = {
    # name: Mamba2Config kwargs (random weights)
    "tiny": dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
                 state_size=16, n_groups=2, expand=2, conv_kernel=4),
    "small": dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_heads=16, head_dim=64,
                  state_size=128, n_groups=1, expand=2, conv_kernel=4),
    "130m": dict(vocab_size=50288, hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64,
                 state_size=128, n_groups=1, expand=2, conv_kernel=4),
    "2.7b": dict(vocab_size=50288, hidden_size=2560, num_hidden_layers=64, num_heads=80, head_dim=64,
                 state_size=128, n_groups=1, expand=2, conv_kernel=4),
}


def mamba2_preset_config(preset: str) -> dict:
    """``config.json`` of the random-weight Mamba-2 of ``preset`` size."""
    return dict(PRESETS[preset], model_type="mamba2", architectures=["Mamba2ForCausalLM"],
                eos_token_id=None, tie_word_embeddings=False, time_step_limit=[0.0, float("inf")],
                residual_in_fp32=True, use_bias=False, use_conv_bias=True, layer_norm_epsilon=1e-5,
                chunk_size=256, hidden_act="silu")


def _random_model_dir(preset: str, root: str, seed: int = 0) -> str:
    """Save a random-weight Mamba-2 of ``preset`` size in HF layout under ``root``.

    The greedy-margin recipe (:mod:`replayssm.models.margin`): embeddings are unit-variance,
    ``lm_head`` is a permutation of the embedding rows scaled by ``1/sqrt(d_model)`` and the
    Mamba-2 ``out_proj`` (the residual branch's output) is at ``0.02 / sqrt(layers)``: the
    residual stream keeps the current token's embedding,
    so the greedy next token is that token's image under the permutation, by a logit margin
    far above bf16 rounding.  With small random heads instead, the logits are nearly flat
    and the verify and decode paths' rounding flips near-ties, so a precomputed greedy
    continuation (the oracle drafter's) goes stale after a few tokens.  The compute is
    the same either way: only the weight values differ.
    """
    if preset in HYBRID_PRESETS:
        return random_hybrid_dir(preset, root, seed)
    cfg = mamba2_preset_config(preset)
    return random_model_dir(root, f"random-mamba2-{preset}", {"config": cfg, "seed": seed},
                            lambda d: _write_random_mamba2(d, preset, cfg, seed))


def _write_random_mamba2(d: Path, preset: str, cfg: dict, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    H, hd, n, G, D = cfg["num_heads"], cfg["head_dim"], cfg["state_size"], cfg["n_groups"], cfg["hidden_size"]
    inter = H * hd
    conv = inter + 2 * G * n
    W = cfg["conv_kernel"]
    V = cfg["vocab_size"]
    r = lambda *s, scale=0.02: (torch.randn(*s, generator=g) * scale).to(torch.bfloat16 if preset == "2.7b" else torch.float32)
    emb = r(V, D, scale=1.0)
    head = permuted_head(emb, torch.randperm(V, generator=g)).to(emb.dtype)
    sd = {"backbone.embeddings.weight": emb, "backbone.norm_f.weight": torch.ones(D), "lm_head.weight": head}
    for i in range(cfg["num_hidden_layers"]):
        p = f"backbone.layers.{i}."
        sd[p + "norm.weight"] = torch.ones(D)
        sd[p + "mixer.in_proj.weight"] = r(2 * inter + 2 * G * n + H, D)
        sd[p + "mixer.conv1d.weight"] = r(conv, 1, W, scale=0.3)
        sd[p + "mixer.conv1d.bias"] = r(conv, scale=0.1)
        sd[p + "mixer.dt_bias"] = torch.log(torch.expm1(torch.empty(H).uniform_(1e-3, 1e-1, generator=g)))
        sd[p + "mixer.A_log"] = torch.log(torch.empty(H).uniform_(1, 16, generator=g))
        sd[p + "mixer.D"] = torch.ones(H)
        sd[p + "mixer.norm.weight"] = torch.ones(inter)
        sd[p + "mixer.out_proj.weight"] = r(D, inter, scale=branch_scale(0.02, cfg["num_hidden_layers"]))
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))


def _load_model(args, tmp: str):
    """(model object or directory, description)."""
    if args.model:
        return args.model, f"model {args.model}"
    kind = HYBRID_PRESETS[args.preset][0]["model_type"] if args.preset in HYBRID_PRESETS else "Mamba-2"
    return _random_model_dir(args.preset, tmp), f"random-weight {kind} ({args.preset})"


class OracleDrafter:
    """Proposes each request's known greedy continuation, each draft corrupted with
    probability ``1 - accept``: isolates the verify/commit path at a chosen acceptance
    (random-weight models accept almost nothing from real drafters)."""

    method = "oracle"
    lazy_catch_up = True   # nothing to run before a plain step

    def __init__(self, refs: dict, k: int, accept: float, vocab: int, device, seed: int = 0):
        import random

        self.refs, self.k, self.accept, self.vocab, self.device = refs, k, accept, vocab, device
        self.rng = random.Random(seed)
        self._seen: dict = {}   # request id -> (its sequence, its continuation)

    def prefill(self, seqs):
        pass

    def release(self, seq):
        self._seen.pop(seq.request_id, None)

    def accepted(self, seqs, accepted, path):
        pass

    def plain_step(self, seqs):
        pass

    def _ref(self, s):
        """``s``'s known continuation (looked up by its prompt once per request)."""
        e = self._seen.get(s.request_id)
        if e is None or e[0] is not s:
            e = self._seen[s.request_id] = (s, self.refs[tuple(s.prompt_ids)])
        return e[1]

    def propose(self, seqs, k=None):
        k = self.k if k is None else k
        B, N = len(seqs), k + 1
        rnd, accept, V = self.rng.random, self.accept, self.vocab
        flat = []  # host ints, one tensor: a tensor per row cost ~1.5 ms a step at B=256
        for s in seqs:
            out = s.output_ids
            d = self._ref(s)[len(out):len(out) + k]
            d = d + [0] * (k - len(d))
            flat.append(s.last_token)
            flat += [t if rnd() < accept else (t + 1) % V for t in d]
        # pinned and asynchronous: a pageable copy would make the host wait for the drafter's
        # kernels queued before it (OracleTokens), a sync no real drafter has
        tokens = host_to_device(torch.frombuffer(array("q", flat), dtype=torch.long).view(B, N), self.device)
        return Proposal(tokens, chain_parent(B, N, self.device),
                        torch.ones(B, N, dtype=torch.bool, device=self.device))


class OracleTokens:
    """A drafter that does ``inner``'s work every step but proposes ``oracle``'s tokens."""

    def __init__(self, inner, oracle):
        self.inner, self.oracle = inner, oracle
        self.method = getattr(inner, "method", "?")
        self.runner = getattr(inner, "runner", None)
        self.lazy_catch_up = getattr(inner, "lazy_catch_up", False)   # its plain steps may overlap

    def prefill(self, seqs):
        self.inner.prefill(seqs)

    def propose(self, seqs, k=None):
        self.inner.propose(seqs, k)
        return self.oracle.propose(seqs, k)

    def accepted(self, seqs, accepted, path):
        self.inner.accepted(seqs, accepted, path)

    def plain_step(self, seqs):
        self.inner.plain_step(seqs)

    def release(self, seq):
        self.inner.release(seq)
        self.oracle.release(seq)

    def reset(self):
        getattr(self.inner, "reset", lambda: None)()


def _prompts(n: int, length: int, vocab: int, seed: int, repetitive: bool = True) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if repetitive:  # a motif repeated: prompt lookup has something to find
            motif = [rng.randrange(vocab) for _ in range(8)]
            p = (motif * (length // 8 + 1))[:length]
        else:
            p = [rng.randrange(vocab) for _ in range(length)]
        out.append(p)
    return out


def _run(LLM, SamplingParams, model, args, batch: int, mode: str, spec=None, prompts=None, **kw) -> dict:
    vocab = int(model.config.vocab_size)
    prompts = prompts or _prompts(batch, args.prompt_len, vocab, seed=batch)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    warm = prompts[:batch]
    refs = None
    oracle = spec is not None and (args.spec_method == "oracle" or (args.spec_method == "mtp" and not args.model))
    if oracle:  # known continuations, before the engine's cache
        ref = LLM(model, device=args.device, dtype=args.dtype, decode_mode="recurrent", max_num_seqs=batch,
                  max_seq_len=args.max_seq_len)
        refs = {tuple(p): o.token_ids for p, o in zip(prompts, ref.generate(prompts, params))}
        warm = [p[:-1] + [(p[-1] + 1) % vocab] for p in prompts[:batch]]  # warm-up prompts need refs too
        refs.update({tuple(p): o.token_ids for p, o in zip(warm, ref.generate(warm, params))})
        del ref
        free_memory(args.device)
    cuda = str(args.device).startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    llm = LLM(model, device=args.device, dtype=args.dtype, decode_mode=mode, buffer_size=args.buffer_size,
              speculative=spec, max_num_seqs=batch, cuda_graphs=args.cuda_graphs, max_seq_len=args.max_seq_len,
              ssm_state_dtype=getattr(args, "ssm_state_dtype", "auto"),
              async_scheduling=getattr(args, "async_scheduling", None), **kw)
    if refs is not None:
        oracle = OracleDrafter(refs, spec.num_tokens, args.oracle_accept, vocab, llm.device)
        if args.spec_method == "mtp":  # random weights: the MTP head drafts, the oracle's tokens are verified
            oracle = OracleTokens(llm.drafter, oracle)
        llm.drafter = oracle
    outs, wall = warm_then_time(llm, warm, prompts, params, args.device)
    gen = sum(len(o.token_ids) for o in outs)
    decode_tokens = gen - len(outs)  # the first token of each comes from prefill
    acc = [o.mean_accepted_length for o in outs]
    num_slots, peak = llm.num_slots, llm.scheduler.peak_running
    stats = dict(llm.stats)
    row = {
        "batch": batch, "mode": mode, "speculative": None if spec is None else spec.method,
        "generated": gen, "wall_s": wall, "tokens_per_s": gen / wall,
        "decode_s": stats["decode_s"], "decode_tokens_per_s": decode_tokens / max(stats["decode_s"], 1e-9),
        "mean_accepted_length": sum(acc) / len(acc), "num_slots": num_slots,
        "peak_running": peak, "capture_s": llm.capture_s,
        "peak_memory_GB": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "draft_length_steps": draft_length_steps(stats),
    }
    del llm
    free_memory(args.device)
    print(f"[bench e2e] {'spec' if spec else 'plain'} {mode} B={batch}: {row['decode_tokens_per_s']:.0f} decode tok/s,"
          f" acc {row['mean_accepted_length']:.2f}, slots {num_slots} (peak {peak}), capture {row['capture_s']:.1f} s"
          + (f", draft lengths {format_lengths(row['draft_length_steps'])}" if spec else "")
          + (f", peak memory {row['peak_memory_GB']:.1f} GB" if cuda else ""), file=sys.stderr, flush=True)
    return row


def format_lengths(hist: dict) -> str:
    """``T=0:12 T=4:30``-style text of a draft-length histogram (lengths never chosen left out)."""
    return " ".join(f"T={t}:{n}" for t, n in sorted(hist.items()) if n) or "-"


def predicted_host_ms(lengths, batch: int) -> dict:
    """``{T: ms}``: the drafter host time (``propose``) the adaptive length policy ``lengths``
    now predicts per step of ``T`` drafts at ``batch`` rows (empty for other policies)."""
    costs = getattr(lengths, "costs", None)
    if costs is None or not hasattr(costs, "host_cost"):
        return {}
    Bp = lengths.bucket(batch)
    return {T: round(costs.host_cost(Bp, T) * 1e3, 3) for T in lengths.lengths}


def predicted_step_ms(lengths, batch: int) -> dict:
    """``{T: ms}``: the device step time ``t(B, T)`` (no flushes, no host drafting) the
    adaptive length policy ``lengths`` now predicts at ``batch`` rows, ``T = 0`` included
    (empty for other policies)."""
    costs = getattr(lengths, "costs", None)
    if costs is None or not hasattr(costs, "host_cost"):
        return {}
    Bp = lengths.bucket(batch)
    return {T: round(costs.get(Bp, T) * 1e3, 3) for T in (0, *lengths.lengths)}


def format_host_ms(host: dict) -> str:
    """``host ms T1 0.12 T4 0.15``-style text of :func:`predicted_host_ms` (empty: ``""``)."""
    return ("host ms " + " ".join(f"T{t} {v:.2f}" for t, v in sorted(host.items()))) if host else ""


def _plots(res: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in sorted({r["mode"] for r in res["throughput"]}):
        rows = [r for r in res["throughput"] if r["mode"] == mode]
        ax.plot([r["batch"] for r in rows], [r["decode_tokens_per_s"] for r in rows], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("throughput vs batch size")
    ax.legend()
    fig.tight_layout()
    f = out / "e2e_throughput.png"
    fig.savefig(f, dpi=120)
    plt.close(fig)
    files.append(str(f))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4))
    labels, tps, acc = [], [], []
    for r in res["speculative"]:
        labels.append(f"{'snapshot' if r['mode'] == 'recurrent' else r['mode']}\nB={r['batch']}")
        tps.append(r["decode_tokens_per_s"])
        acc.append(r["mean_accepted_length"])
    a1.bar(range(len(tps)), tps, color=["tab:gray" if "snapshot" in l else "tab:blue" for l in labels])
    a1.set_xticks(range(len(tps)), labels, fontsize=7)
    a1.set_ylabel("decode tokens/s")
    a1.set_title(f"speculation ({res['config']['spec_method']}, T={res['config']['num_tokens']})")
    a2.bar(range(len(acc)), acc)
    a2.set_xticks(range(len(acc)), labels, fontsize=7)
    a2.set_ylabel("mean accepted length")
    fig.tight_layout()
    f = out / "e2e_speculative.png"
    fig.savefig(f, dpi=120)
    plt.close(fig)
    files.append(str(f))

    rows = res["concurrency"]
    if not rows:
        return files
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(range(len(rows)), [r["max_sequences"] for r in rows])
    ax.set_xticks(range(len(rows)), [r["label"] for r in rows], fontsize=7, rotation=20)
    ax.set_ylabel("sequences in budget")
    ax.set_title(f"max concurrency in {res['config']['memory_budget'] / 2**20:.1f} MiB")
    fig.tight_layout()
    f = out / "e2e_concurrency.png"
    fig.savefig(f, dpi=120)
    plt.close(fig)
    files.append(str(f))
    return files


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replayssm bench e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: random weights, --preset)")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS) + sorted(HYBRID_PRESETS))
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--batch-sizes", type=int_list, default="1,4,16,64,256,512")
    p.add_argument("--modes", default="recurrent,replay", help="decode modes for the throughput sweep")
    p.add_argument("--spec-batch-sizes", type=int_list, default="1,16,64")
    p.add_argument("--spec-modes", default="recurrent,replay",
                   help="modes of the speculative runs (recurrent: the snapshot baseline)")
    p.add_argument("--spec-method", default=None, choices=["oracle", "ngram", "draft", "tree", "mtp"],
                   help="default: oracle for random weights (known continuation, --oracle-accept), else ngram; "
                        "mtp: the model's MTP head (random weights: a random head drafts, the oracle's tokens "
                        "are verified)")
    p.add_argument("--oracle-accept", type=probability, default=1.0, help="oracle: probability each draft is right")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--num-tokens", type=positive_int, default=4)
    p.add_argument("--spec-policy", default="adaptive", choices=["adaptive", "fixed"],
                   help="draft length per step: adaptive (0..num-tokens, by measured acceptance and step cost) "
                        "or fixed (always num-tokens)")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--max-seq-len", type=positive_int, default=None, help="default: prompt + max tokens + margin")
    p.add_argument("--buffer-size", type=positive_int, default=16)
    p.add_argument("--ssm-state-dtype", "--mamba-ssm-cache-dtype", dest="ssm_state_dtype", default="auto",
                   choices=list(STATE_DTYPES), help="storage dtype of the SSM checkpoint states (default: float32)")
    p.add_argument("--memory-budget", type=positive_float, default=None, help="bytes (default: 64 replay sequences)")
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="throughput and speculative runs: async scheduling (plain greedy decode steps overlap; "
                        "default: the engine's, on for CUDA)")
    p.add_argument("--skip-concurrency", action="store_true", help="skip section 3 (sequences in a memory budget)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N GPUs (loaded once, shared by every run)")
    g = p.add_argument_group("workloads (replayssm.bench.ttft, replayssm.bench.prefix)")
    g.add_argument("--workload", default="decode",
                   help="decode: the sweeps above; prefill: time to first token and chunked prefill under load; "
                        "shared-prefix and/or chat (comma-separated): TTFT and throughput with prefix caching "
                        "off vs on")
    g.add_argument("--workload-mode", default="replay", choices=["recurrent", "replay", "kv", "auto"],
                   help="workloads: decode mode")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=8192,
                   help="prefill: the engine's tokens per step (chunked prefill budget)")
    g.add_argument("--ttft-lens", type=int_list, default="2048,8192,32768", help="prefill: prompt lengths")
    g.add_argument("--ttft-batches", type=int_list, default="1,16", help="prefill: prompts submitted together")
    g.add_argument("--mixed-decoders", type=positive_int, default=16, help="prefill: requests decoding ...")
    g.add_argument("--mixed-max-tokens", type=positive_int, default=256, help="... this many tokens each ...")
    g.add_argument("--mixed-prompts", type=nonnegative_int, default=4, help="... when this many long prompts arrive (0: skip)")
    g.add_argument("--mixed-len", type=positive_int, default=32768,
                   help="... of this many tokens (longer than the budget: chunked prefill splits them)")
    g.add_argument("--prefix-memory", action="store_true",
                   help="print memory per cached token, ours vs state-per-block, for --memory-presets")
    g.add_argument("--memory-presets", default="2.7b,nemotron-h-4b,qwen3-next-4b")
    g.add_argument("--prefix-len", type=positive_int, default=4096, help="shared-prefix: system prompt tokens")
    g.add_argument("--question-len", type=positive_int, default=64, help="shared-prefix: tokens per question")
    g.add_argument("--num-questions", type=positive_int, default=64)
    g.add_argument("--conversations", type=positive_int, default=16, help="chat: conversations")
    g.add_argument("--turns", type=positive_int, default=4, help="chat: turns per conversation")
    g.add_argument("--turn-len", type=positive_int, default=64, help="chat: tokens per user message")
    g.add_argument("--max-num-seqs", type=positive_int, default=64, help="prefix workloads: engine slots")
    g.add_argument("--prefix-checkpoint-interval", type=positive_int, default=None)
    p.add_argument("--out", default="out/bench_e2e")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (< 30 s) for CI")
    p.add_argument("--no-plots", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.device = args.device or "cpu"
        args.preset = TINY_OF.get(args.preset, "tiny") if args.model is None else args.preset
        args.batch_sizes, args.spec_batch_sizes = "1,4", "4"
        args.max_tokens, args.prompt_len = 8, 16
        args.ttft_lens, args.ttft_batches, args.max_num_batched_tokens = "24,40", "1,3", 16
        args.mixed_decoders, args.mixed_max_tokens, args.mixed_prompts, args.mixed_len = 3, 12, 2, 40
        args.prefix_len, args.question_len, args.num_questions = 40, 6, 4
        args.conversations, args.turns, args.turn_len, args.max_num_seqs = 2, 2, 18, 4
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda":
        args.device = f"cuda:{torch.cuda.current_device()}"
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.spec_method == "draft" and not args.draft_model:
        print("replayssm bench e2e: error: --spec-method draft needs --draft-model", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.workload == "prefill":
        return _prefill_main(args, out)
    if args.prefix_memory or args.workload != "decode":
        return _prefix_main(args, out)
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    spec_batches = [int(b) for b in args.spec_batch_sizes.split(",") if b]
    modes = [m for m in args.modes.split(",") if m]
    if args.spec_method is None:
        args.spec_method = "ngram" if args.model else "oracle"
    method = "ngram" if args.spec_method == "oracle" else args.spec_method
    spec = SpeculativeConfig(method, num_tokens=args.num_tokens, draft_model=args.draft_model,
                             spec_policy=args.spec_policy)
    if args.max_seq_len is None:
        need = args.prompt_len + args.max_tokens + 2 * spec.verify_tokens + 16
        args.max_seq_len = -(-need // 64) * 64
    buffer_needed = 2 * spec.verify_tokens
    if args.buffer_size < buffer_needed:
        args.buffer_size = buffer_needed
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model, desc = _load_model(args, tmp)
        if isinstance(model, str):  # load once, share between engines
            if args.spec_method == "mtp" and not args.model:
                add_random_mtp(model)
            model_obj = load(model, torch.device(args.device), getattr(torch, args.dtype),
                             args.tensor_parallel_size, mtp=args.spec_method == "mtp")[0]
        else:
            model_obj = model
        res = {"config": {**vars(args), "model_desc": desc, "spec_method": args.spec_method,
                          "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"},
               "throughput": [], "speculative": [], "concurrency": []}
        jobs = [("throughput", m, b) for m in modes for b in batches]
        spec_modes = [m for m in args.spec_modes.split(",") if m]
        jobs += [("speculative", m, b) for b in spec_batches for m in spec_modes]
        conc_modes = [("recurrent", None), ("replay", None), ("recurrent", spec), ("replay", spec), ("kv", None)]
        jobs += [] if args.skip_concurrency else [("concurrency", m, s) for m, s in conc_modes]
        bar = tqdm(jobs, desc="bench e2e", unit="run", file=sys.stderr)
        budget = args.memory_budget
        for kind, mode, arg in bar:
            bar.set_postfix_str(f"{kind} {mode} {arg if not hasattr(arg, 'method') else arg.method}")
            if kind == "throughput":
                res["throughput"].append(_run(LLM, SamplingParams, model_obj, args, arg, mode))
            elif kind == "speculative":
                res["speculative"].append(_run(LLM, SamplingParams, model_obj, args, arg, mode, spec=spec))
            else:
                probe = LLM(model_obj, device=args.device, dtype=args.dtype, decode_mode="replay",
                            buffer_size=args.buffer_size, max_num_seqs=1, max_seq_len=args.max_seq_len,
                            ssm_state_dtype=args.ssm_state_dtype)
                per_seq_tokens = args.prompt_len + args.max_tokens
                if budget is None:
                    budget = (8 if args.smoke else 64) * probe.plan.memory.need(per_seq_tokens)
                    res["config"]["memory_budget"] = budget
                del probe
                free_memory(args.device)
                llm = LLM(model_obj, device=args.device, dtype=args.dtype, decode_mode=mode, speculative=arg,
                          buffer_size=args.buffer_size, max_num_seqs=100_000, memory_budget=int(budget),
                          max_seq_len=args.max_seq_len, ssm_state_dtype=args.ssm_state_dtype)
                fit = llm.num_slots
                if mode == "kv":
                    fit = min(fit, int(budget // llm.plan.memory.need(per_seq_tokens + llm.plan.memory.verify_tokens)))
                row = {"label": f"{'snapshot' if mode == 'recurrent' and arg else mode}{'+spec' if arg else ''}",
                       "mode": mode, "speculative": arg is not None, "max_sequences": int(fit),
                       "bytes_per_sequence": llm.plan.memory.need(per_seq_tokens)}
                if mode != "kv" and fit <= 64:  # check by running 2x that many short requests
                    n = min(2 * fit, 128)
                    llm.generate(_prompts(n, 8, llm.vocab_size, 0), SamplingParams(max_tokens=2, ignore_eos=True))
                    row["observed_peak_batch"] = llm.scheduler.peak_running
                res["concurrency"].append(row)
                del llm
                free_memory(args.device)
        bar.close()
        if args.tensor_parallel_size > 1:
            model_obj.close()   # stops the workers
    res["config"]["memory_budget"] = budget
    res["elapsed_s"] = time.perf_counter() - t_start
    # summary ratios
    summ = {}
    for b in batches:
        r = {x["mode"]: x for x in res["throughput"] if x["batch"] == b}
        if "replay" in r and "recurrent" in r:
            summ[f"replay_vs_recurrent_B{b}"] = r["replay"]["decode_tokens_per_s"] / r["recurrent"]["decode_tokens_per_s"]
    for b in spec_batches:
        r = {x["mode"]: x for x in res["speculative"] if x["batch"] == b}
        if "replay" in r and "recurrent" in r:
            summ[f"replay_spec_vs_snapshot_B{b}"] = r["replay"]["decode_tokens_per_s"] / r["recurrent"]["decode_tokens_per_s"]
        std = {x["mode"]: x for x in res["throughput"] if x["batch"] == b}
        if "replay" in r and "recurrent" in std:  # standard decoding = the engine's recurrent mode
            summ[f"replay_spec_vs_standard_B{b}"] = (r["replay"]["decode_tokens_per_s"]
                                                     / std["recurrent"]["decode_tokens_per_s"])
    c = {x["label"]: x["max_sequences"] for x in res["concurrency"]}
    if c.get("snapshot+spec"):
        summ["concurrency_replay_spec_vs_snapshot"] = c.get("replay+spec", 0) / c["snapshot+spec"]
    res["summary"] = summ
    (out / "e2e.json").write_text(json.dumps(res, indent=1, default=str))
    files = []
    if not args.no_plots:
        try:
            files = _plots(res, out)
        except ImportError:
            print("replayssm bench e2e: plots skipped: matplotlib is not installed "
                  "(pip install 'replayssm[bench]')", file=sys.stderr)
    print(f"model: {desc}; device {res['config']['device_name']}; dtype {args.dtype}")
    print(f"{'kind':<12}{'mode':<11}{'batch':>6}{'tok/s':>11}{'decode tok/s':>14}{'acc len':>9}  draft lengths")
    for kind in ("throughput", "speculative"):
        for r in res[kind]:
            print(f"{kind:<12}{('snapshot' if kind == 'speculative' and r['mode'] == 'recurrent' else r['mode']):<11}"
                  f"{r['batch']:>6}{r['tokens_per_s']:>11.1f}{r['decode_tokens_per_s']:>14.1f}"
                  f"{r['mean_accepted_length']:>9.2f}"
                  + (f"  {format_lengths(r['draft_length_steps'])}" if kind == "speculative" else ""))
    for r in res["concurrency"]:
        print(f"concurrency {r['label']:<16} {r['max_sequences']:>6} sequences"
              + (f" (observed peak batch {r['observed_peak_batch']})" if "observed_peak_batch" in r else ""))
    for k, v in summ.items():
        print(f"{k}: {v:.2f}x")
    print(f"wrote {out / 'e2e.json'}" + (f" and {len(files)} plots" if files else "") + f" in {res['elapsed_s']:.1f}s")
    return 0


def _prefix_main(args, out: Path) -> int:
    """``--prefix-memory`` and the prefix-caching workloads (:mod:`replayssm.bench.prefix`)."""
    if args.prefix_memory:
        rows = [prefix.memory_per_token(p, mamba2_preset_config(p) if p in PRESETS else preset_config(p), "bfloat16",
                                        16, args.prefix_checkpoint_interval)
                for p in args.memory_presets.split(",") if p]
        (out / "prefix_memory.json").write_text(json.dumps(rows, indent=1, default=str))
        prefix.print_memory(rows)
        if args.workload == "decode":
            return 0
    bad = [w for w in args.workload.split(",") if w not in ("shared-prefix", "chat")]
    if bad:
        print(f"replayssm bench e2e: error: unknown --workload {bad[0]!r} (decode, prefill, shared-prefix, chat)",
              file=sys.stderr)
        return 2
    if args.max_seq_len is None:
        need = max(args.prefix_len + args.question_len, args.turns * (args.turn_len + args.max_tokens)) \
            + args.max_tokens + 16
        args.max_seq_len = -(-need // 64) * 64
    return _with_model(args, lambda model, desc: prefix.run(model, args, out, desc))


def _prefill_main(args, out: Path) -> int:
    """``--workload prefill`` (:mod:`replayssm.bench.ttft`)."""
    args.ttft_lens = [int(x) for x in args.ttft_lens.split(",") if x]
    args.ttft_batches = [int(x) for x in args.ttft_batches.split(",") if x]
    return _with_model(args, lambda model, desc: ttft.run(model, args, out, desc))


def _with_model(args, fn) -> int:
    """Load ``--model`` / the random ``--preset`` once and run ``fn(model, description)``."""
    with tempfile.TemporaryDirectory() as tmp:
        model, desc = _load_model(args, tmp)
        if isinstance(model, str):
            model = load(model, torch.device(args.device), getattr(torch, args.dtype), args.tensor_parallel_size)[0]
        try:
            return fn(model, desc)
        finally:
            if args.tensor_parallel_size > 1:
                model.close()   # stops the workers


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
