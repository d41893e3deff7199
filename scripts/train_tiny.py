#!/usr/bin/env python3
"""Train the tiny byte-level Mamba-2 models that ship in ``replayssm/assets/``.

Two models share one byte tokenizer (ids 0..255 are the bytes themselves, 256 is ``<eos>``):

* ``target``: ~5.5M parameters (hidden 320, 8 layers, d_state 64, head_dim 64, 1 group)
* ``draft``:  ~0.8M parameters (hidden 160, 4 layers, d_state 64, head_dim 32, 1 group)
* the target's MTP head (``--stage mtp``): ~0.87M parameters (one Mamba-2 block shaped like the
  target's, an fc over [norm(embedding); norm(hidden)] and an output norm), trained on the frozen
  target by distillation (the target's own next-token distribution) on CPU

The corpus is the Python standard library's own ``*.py`` files (every machine has one), in
sorted path order, one ``<eos>`` between files; files whose path hashes to 0 mod 40 are held
out for validation.  The model is ``transformers.Mamba2ForCausalLM``; the checkpoint is an
ordinary Hugging Face ``mamba2`` directory (config.json + model.safetensors + tokenizer.json).

For speed, training swaps transformers' reference chunked scan (which materialises
``[batch, chunks, L, L, heads, d_state]`` products) for an einsum form of the same SSD
computation; ``check_fast_scan`` compares the two in float64 before every run.  Saved models
use transformers' own code unchanged.

Usage::

    python3 scripts/train_tiny.py --smoke                       # a few CPU steps (CI)
    python3 scripts/train_tiny.py --pack-corpus .corpus         # freeze the corpus to a folder
    python3 scripts/train_tiny.py --model target --corpus .corpus --device cuda \
        --steps 6000 --out runs/target                          # train one model
    python3 scripts/train_tiny.py --report replayssm/assets     # samples + draft agreement (CPU)
    python3 scripts/train_tiny.py --stage mtp --time-budget 1500  # MTP head of tiny-mamba2 (CPU)

See docs/TRAINING.md for the commands and results of the shipped run.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

EOS_ID = 256
VOCAB_SIZE = 257
VAL_MOD = 40  # a file is held out when sha1(relpath) % VAL_MOD == 0
MAX_FILE_BYTES = 512 * 1024  # skips pydoc_data/topics.py (documentation text, not code)

MODEL_PRESETS = {
    # name: Mamba2Config keyword arguments (vocab and special ids are added by make_config)
    "target": dict(hidden_size=320, num_hidden_layers=8, state_size=64, head_dim=64, expand=2,
                   n_groups=1, conv_kernel=4),
    "draft": dict(hidden_size=160, num_hidden_layers=4, state_size=64, head_dim=32, expand=2,
                  n_groups=1, conv_kernel=4),
    # for --smoke only
    "smoke": dict(hidden_size=64, num_hidden_layers=2, state_size=16, head_dim=16, expand=2,
                  n_groups=1, conv_kernel=4),
}
DEFAULT_LR = {"target": 2e-3, "draft": 3e-3, "smoke": 3e-3}


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table (what tokenizers' ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer():
    """A byte-level tokenizer with id == byte value for 0..255 and ``<eos>`` = 256."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True, normalized=False)])
    assert tok.token_to_id("<eos>") == EOS_ID
    # Prompts start like a file: "<eos>" precedes every file in the training stream, so it marks
    # "start of a document" (column 0, top level).  Without it a prompt such as "def f(n):" is
    # read as a line somewhere inside a file and greedy decoding drifts into indentation.
    tok.post_processor = processors.TemplateProcessing(
        single="<eos> $A", pair="<eos> $A <eos> $B", special_tokens=[("<eos>", EOS_ID)])
    return tok


def check_tokenizer(tok) -> None:
    samples = ["def fibonacci(n):\n    return n", "naïve → ✓ \t\r\n\x00\x7f", bytes(range(256)).decode("latin-1")]
    for s in samples:
        ids = tok.encode(s, add_special_tokens=False).ids
        assert ids == list(s.encode("utf-8")), (s, ids[:20])
        assert tok.decode(ids) == s
        assert tok.encode(s).ids == [EOS_ID] + ids  # document-start marker
        assert tok.decode([EOS_ID] + ids) == s  # decode drops <eos>
    assert tok.encode("ab<eos>", add_special_tokens=False).ids == [97, 98, EOS_ID]


def save_tokenizer(tok, out_dir: Path) -> None:
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "bos_token": "<eos>",
           "pad_token": "<eos>", "model_max_length": 1_000_000, "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------------------------

def stdlib_files(root: str | None = None) -> tuple[Path, list[str]]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for f in filenames:
            if f.endswith(".py"):
                p = Path(dirpath) / f
                if p.is_file() and not p.is_symlink() and p.stat().st_size <= MAX_FILE_BYTES:
                    rels.append(p.relative_to(root).as_posix())
    return root, sorted(rels)


def is_val(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % VAL_MOD == 0


def build_corpus(root: str | None = None) -> dict:
    """Returns {'train': bytes, 'val': bytes, 'manifest': {...}}; files joined by byte 0 markers
    are NOT used: documents are kept as a list of lengths so <eos> (id 256) can be inserted."""
    root, rels = stdlib_files(root)
    out = {"train": [], "val": []}
    files = {"train": [], "val": []}
    for rel in rels:
        data = (root / rel).read_bytes()
        split = "val" if is_val(rel) else "train"
        out[split].append(data)
        files[split].append([rel, len(data)])
    blob = {k: b"".join(v) for k, v in out.items()}
    manifest = {
        "source": str(root),
        "python": sys.version.split()[0],
        "rule": f"*.py under stdlib, excluding site-packages and files > {MAX_FILE_BYTES} bytes; "
                f"val = sha1(relpath) % {VAL_MOD} == 0; sorted paths; <eos> after each file",
        "files": files,
        "bytes": {k: len(v) for k, v in blob.items()},
        "sha256": {k: hashlib.sha256(v).hexdigest() for k, v in blob.items()},
    }
    return {"train": blob["train"], "val": blob["val"], "manifest": manifest}


def pack_corpus(dest: Path, root: str | None = None) -> dict:
    c = build_corpus(root)
    dest.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        with gzip.open(dest / f"{split}.bin.gz", "wb", compresslevel=6) as fh:
            fh.write(c[split])
    (dest / "manifest.json").write_text(json.dumps(c["manifest"], indent=1) + "\n")
    return c["manifest"]


def load_corpus(src: Path | None, root: str | None = None) -> dict:
    if src is None:
        return build_corpus(root)
    manifest = json.loads((src / "manifest.json").read_text())
    c = {"manifest": manifest}
    for split in ("train", "val"):
        with gzip.open(src / f"{split}.bin.gz", "rb") as fh:
            c[split] = fh.read()
        assert hashlib.sha256(c[split]).hexdigest() == manifest["sha256"][split], f"{split} corrupt"
    return c


def to_tokens(blob: bytes, lengths: list[int]) -> torch.Tensor:
    """bytes + per-file lengths -> int16 token stream with <eos> after each file."""
    import numpy as np
    raw = np.frombuffer(blob, dtype=np.uint8)
    out = np.empty(len(raw) + len(lengths), dtype=np.int16)
    src = dst = 0
    for n in lengths:
        out[dst:dst + n] = raw[src:src + n]
        out[dst + n] = EOS_ID
        src += n
        dst += n + 1
    assert src == len(raw)
    return torch.from_numpy(out)


# --------------------------------------------------------------------------------------------
# fast (einsum) SSD scan used during training
# --------------------------------------------------------------------------------------------

TRAIN_CHUNK = 64


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = sum_{j < k <= i} x[..., k] for i >= j, -inf above the diagonal."""
    T = x.size(-1)
    xe = x[..., None].expand(*x.shape, T)
    strict = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=-1)
    xs = torch.cumsum(xe.masked_fill(~strict, 0), dim=-2)
    incl = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=0)
    return xs.masked_fill(~incl, -torch.inf)


def fast_chunk_scan(hidden_states, dt, A, B, C, chunk_size=None, D=None, dt_bias=None,
                    initial_states=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                    return_final_states=False, **kwargs):
    """Same function as transformers' ``mamba2_chunk_scan`` (no initial state, no final state),
    computed with einsums on [chunk, chunk] blocks; float32 inside, autocast off."""
    if initial_states is not None or return_final_states:
        return _ORIG_CHUNK_SCAN(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                                initial_states=initial_states, dt_softplus=dt_softplus,
                                dt_limit=dt_limit, return_final_states=return_final_states)
    dev = hidden_states.device.type
    with torch.autocast(device_type=dev, enabled=False):
        b, L, h, p = hidden_states.shape
        g, n = B.shape[2], B.shape[3]
        hpg = h // g
        ftype = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
        dt = dt.to(ftype)
        if dt_bias is not None:
            dt = dt + dt_bias.to(ftype)
        if dt_softplus:
            dt = F.softplus(dt)
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
        x = hidden_states.to(ftype)
        Bf, Cf = B.to(ftype), C.to(ftype)
        cs = TRAIN_CHUNK
        pad = (-L) % cs
        xp, dtp = x, dt
        if pad:  # zero dt on the padding: it adds nothing and decays nothing
            xp = F.pad(xp, (0, 0, 0, 0, 0, pad))
            dtp = F.pad(dtp, (0, 0, 0, pad))
            Bf = F.pad(Bf, (0, 0, 0, 0, 0, pad))
            Cf = F.pad(Cf, (0, 0, 0, 0, 0, pad))
        nc = (L + pad) // cs
        xp = xp.reshape(b, nc, cs, h, p)
        dtp = dtp.reshape(b, nc, cs, h)
        Bf = Bf.reshape(b, nc, cs, g, n)
        Cf = Cf.reshape(b, nc, cs, g, n)
        dA = (dtp * A.to(ftype)).permute(0, 3, 1, 2)  # b h c l
        Acs = torch.cumsum(dA, dim=-1)
        Lmat = torch.exp(_segsum(dA))  # b h c l s
        CB = torch.einsum("bclgn,bcsgn->bcgls", Cf, Bf)
        CB = CB.unsqueeze(3).expand(b, nc, g, hpg, cs, cs).reshape(b, nc, h, cs, cs)
        M = CB * Lmat.permute(0, 2, 1, 3, 4)  # b c h l s
        xdt = xp * dtp.unsqueeze(-1)  # b c s h p
        y_diag = torch.einsum("bchls,bcshp->bclhp", M, xdt)
        Bh = Bf.unsqueeze(4).expand(b, nc, cs, g, hpg, n).reshape(b, nc, cs, h, n)
        Ch = Cf.unsqueeze(4).expand(b, nc, cs, g, hpg, n).reshape(b, nc, cs, h, n)
        decay_states = torch.exp(Acs[..., -1:] - Acs)  # b h c s
        states = torch.einsum("bcshn,bhcs,bcshp->bchpn", Bh, decay_states, xdt)
        states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
        decay_chunk = torch.exp(_segsum(F.pad(Acs[..., -1], (1, 0))))  # b h c+1 c+1
        states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
        y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", Ch, states, torch.exp(Acs))
        y = (y_diag + y_off).reshape(b, nc * cs, h, p)[:, :L]
        if D is not None:
            y = y + D.to(ftype)[:, None] * x
        return y


_ORIG_CHUNK_SCAN = None


def install_fast_scan() -> None:
    global _ORIG_CHUNK_SCAN
    import transformers.models.mamba2.modeling_mamba2 as mm
    if _ORIG_CHUNK_SCAN is None:
        _ORIG_CHUNK_SCAN = mm.mamba2_chunk_scan
    mm.mamba2_chunk_scan = fast_chunk_scan


def uninstall_fast_scan() -> None:
    import transformers.models.mamba2.modeling_mamba2 as mm
    if _ORIG_CHUNK_SCAN is not None:
        mm.mamba2_chunk_scan = _ORIG_CHUNK_SCAN


def check_fast_scan() -> float:
    """Fast scan vs transformers' reference, float64, ragged length, 2 groups; returns rel err."""
    import transformers.models.mamba2.modeling_mamba2 as mm
    ref_fn = _ORIG_CHUNK_SCAN or mm.mamba2_chunk_scan
    g = torch.Generator().manual_seed(0)
    b, L, h, p, gr, n = 2, 150, 4, 8, 2, 16
    x = torch.randn(b, L, h, p, generator=g, dtype=torch.float64)
    dt = torch.randn(b, L, h, generator=g, dtype=torch.float64)
    A = -torch.rand(h, generator=g, dtype=torch.float64) * 4
    B = torch.randn(b, L, gr, n, generator=g, dtype=torch.float64)
    C = torch.randn(b, L, gr, n, generator=g, dtype=torch.float64)
    D = torch.randn(h, generator=g, dtype=torch.float64)
    dtb = torch.randn(h, generator=g, dtype=torch.float64)
    kw = dict(D=D, dt_bias=dtb, dt_softplus=True, dt_limit=(0.0, float("inf")))
    got = fast_chunk_scan(x, dt, A, B, C, 32, **kw)
    # 1) the plain recurrence S_t = a_t S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t + D x_t, float64
    d = F.softplus(dt + dtb)
    hg = h // gr
    S = torch.zeros(b, h, p, n, dtype=torch.float64)
    ys = []
    for t in range(L):
        Bt = B[:, t].repeat_interleave(hg, dim=1)  # b h n
        Ct = C[:, t].repeat_interleave(hg, dim=1)
        a = torch.exp(A * d[:, t])  # b h
        S = a[..., None, None] * S + (d[:, t, :, None] * x[:, t])[..., None] * Bt[:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ct) + D[:, None] * x[:, t])
    rec = torch.stack(ys, dim=1)
    err_rec = ((got - rec).norm() / rec.norm()).item()
    assert err_rec < 1e-10, f"fast scan disagrees with the float64 recurrence: rel err {err_rec:.3e}"
    # 2) transformers' reference (which computes in float32 internally)
    ref = ref_fn(x, dt, A, B, C, 32, **kw).double()
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 1e-5, f"fast scan disagrees with transformers' reference: rel err {err:.3e}"
    return max(err_rec, err)


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------

def make_config(preset: str):
    from transformers import Mamba2Config
    kw = dict(MODEL_PRESETS[preset])
    inter = kw["hidden_size"] * kw["expand"]
    kw["num_heads"] = inter // kw["head_dim"]
    return Mamba2Config(
        vocab_size=VOCAB_SIZE, bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
        tie_word_embeddings=False, use_bias=False, use_conv_bias=True, residual_in_fp32=True,
        initializer_range=0.02, rescale_prenorm_residual=True, chunk_size=256,
        layer_norm_epsilon=1e-5, use_cache=True, **kw)


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int, device, amp: bool) -> float:
    model.eval()
    tot, cnt = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i:i + batch_size].to(device=device, dtype=torch.long)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=w[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                               reduction="sum")
        tot += loss.item()
        cnt += w[:, 1:].numel()
    model.train()
    return tot / cnt


def fixed_windows(tokens: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """`count` evenly spaced windows of seq_len+1 tokens (deterministic)."""
    n = tokens.numel() - (seq_len + 1)
    count = max(1, min(count, n // (seq_len + 1)))
    starts = torch.linspace(0, n, count).long()
    return torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()])


def plot_losses(log: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    tr = log["train"]
    if tr:
        ax.plot([r["step"] for r in tr], [r["loss"] for r in tr], lw=1, alpha=0.8, label="train (running mean)")
    va = log["val"]
    if va:
        ax.plot([r["step"] for r in va], [r["loss"] for r in va], "o-", ms=3, label="val (held-out files)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(f"{log['name']}: {log['params'] / 1e6:.2f}M params, {log['device_name']}")
    if tr:
        lo = min([r["loss"] for r in tr] + [r["loss"] for r in va])
        ax.set_ylim(max(0.0, lo - 0.1), min(3.5, max(r["loss"] for r in tr)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def train(args) -> dict:
    from transformers import Mamba2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    t_start = time.time()
    device = torch.device(args.device)
    amp = device.type == "cuda"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    install_fast_scan()
    scan_err = check_fast_scan()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(Path(args.corpus) if args.corpus else None, args.stdlib)
    man = corpus["manifest"]
    train_tok = to_tokens(corpus["train"], [n for _, n in man["files"]["train"]])
    val_tok = to_tokens(corpus["val"], [n for _, n in man["files"]["val"]])
    if args.smoke:
        train_tok = train_tok[:200_000]
    print(f"[{args.model}] corpus: python {man['python']} stdlib, train {train_tok.numel():,} tokens "
          f"({len(man['files']['train'])} files), val {val_tok.numel():,} tokens "
          f"({len(man['files']['val'])} files); fast-scan check rel err {scan_err:.1e}", flush=True)

    torch.manual_seed(args.seed)
    cfg = make_config(args.model)
    model = Mamba2ForCausalLM(cfg).to(device)
    model.train()
    n_params = count_params(model)
    print(f"[{args.model}] {n_params:,} parameters; config {MODEL_PRESETS[args.model]}", flush=True)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "conv1d" not in name else no_decay).append(p)
    lr = args.lr or DEFAULT_LR[args.model]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)

    train_dev = train_tok.to(device)
    val_windows = fixed_windows(val_tok, args.seq_len, args.eval_windows)
    train_windows = fixed_windows(train_tok, args.seq_len, args.eval_windows)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    offs = torch.arange(args.seq_len + 1, device=device)
    n_start = train_dev.numel() - (args.seq_len + 1)

    total = args.steps
    warmup = min(args.warmup, max(1, total // 10))
    probe_at = 40
    log = {"name": args.model, "params": n_params, "config": cfg.to_dict(), "args": vars(args),
           "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
           "torch": torch.__version__, "corpus": {k: man[k] for k in ("python", "rule", "bytes", "sha256")},
           "val_files": [f for f, _ in man["files"]["val"]], "train": [], "val": [], "lr_peak": lr}
    import transformers
    log["transformers"] = transformers.__version__

    try:
        from tqdm import tqdm
        bar = tqdm(total=total, desc=args.model, mininterval=10.0, file=sys.stdout)
    except ImportError:  # pragma: no cover
        bar = None
    run_loss, run_n = 0.0, 0
    t_train0 = time.time()
    t_probe = None
    step = 0
    stopped_early = False
    while step < total:
        if args.time_budget and step == 10:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_probe = time.time()
        if args.time_budget and step == probe_at and t_probe is not None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_probe) / (probe_at - 10)
            remaining = args.time_budget - (time.time() - t_start)
            # evals cost ~ (2 * eval_windows / batch) forward passes each; keep a 10% margin
            n_evals = max(1, total // args.eval_every)
            new_total = step + int(0.9 * remaining / per_step) - n_evals
            total = max(step + 1, min(args.steps, new_total))
            warmup = min(args.warmup, max(1, total // 10))
            log["step_time_probe_s"] = per_step
            print(f"\n[{args.model}] probe: {per_step * 1e3:.1f} ms/step -> {total} steps "
                  f"(budget {args.time_budget:.0f}s)", flush=True)
            if bar is not None:
                bar.total = total
        cur_lr = lr_at(step, total, lr, warmup)
        for gparam in opt.param_groups:
            gparam["lr"] = cur_lr
        starts = torch.randint(0, n_start, (args.batch_size,), device=device, generator=gen)
        batch = train_dev[starts[:, None] + offs].long()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        run_loss += loss.detach()
        run_n += 1
        if step % args.log_every == 0 or step == total:
            lv = (run_loss / run_n).item()
            log["train"].append({"step": step, "loss": lv, "lr": cur_lr, "grad_norm": float(gnorm),
                                 "time_s": time.time() - t_train0})
            if not math.isfinite(lv):
                raise RuntimeError(f"loss is {lv} at step {step}")
            run_loss, run_n = 0.0, 0
            if bar is not None:
                bar.set_postfix(loss=f"{lv:.3f}", lr=f"{cur_lr:.1e}", refresh=False)
        if step % args.eval_every == 0 or step == total:
            vl = evaluate(model, val_windows, args.batch_size, device, amp)
            log["val"].append({"step": step, "loss": vl, "time_s": time.time() - t_train0})
            print(f"\n[{args.model}] step {step}/{total} train {log['train'][-1]['loss']:.4f} "
                  f"val {vl:.4f} ({time.time() - t_train0:.0f}s)", flush=True)
        if bar is not None:
            bar.update(1)
        if args.time_budget and time.time() - t_start > 1.15 * args.time_budget:
            stopped_early = True
            print(f"\n[{args.model}] hard stop at step {step}: over the time budget", flush=True)
            break
    if bar is not None:
        bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_time = time.time() - t_train0
    log.update(steps=step, planned_steps=total, stopped_early=stopped_early, train_time_s=train_time,
               tokens_seen=step * args.batch_size * args.seq_len)

    # round to the shipped dtype, then measure final losses in float32 on the rounded weights
    uninstall_fast_scan()
    model = model.float()
    if args.save_dtype == "bfloat16":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    install_fast_scan()
    log["final"] = {
        "val_loss": evaluate(model, val_windows, args.batch_size, device, False),
        "train_loss": evaluate(model, train_windows, args.batch_size, device, False),
        "eval_windows": int(val_windows.shape[0]), "seq_len": args.seq_len,
        "weights": args.save_dtype, "note": "float32 math on the saved (rounded) weights",
    }
    log["final"]["val_bits_per_byte"] = log["final"]["val_loss"] / math.log(2)
    uninstall_fast_scan()

    save_dtype = torch.bfloat16 if args.save_dtype == "bfloat16" else torch.float32
    model.to(save_dtype).save_pretrained(out, safe_serialization=True)
    tok = build_tokenizer()
    check_tokenizer(tok)
    save_tokenizer(tok, out)
    log["wall_time_s"] = time.time() - t_start
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    plot_losses(log, out / "loss.png")
    f = log["final"]
    print(f"[{args.model}] done: {step} steps in {train_time:.0f}s, final train {f['train_loss']:.4f} "
          f"val {f['val_loss']:.4f} nats/byte ({f['val_bits_per_byte']:.3f} bits/byte) -> {out}", flush=True)
    return log


# --------------------------------------------------------------------------------------------
# MTP head (stage "mtp"): trained on the frozen target, CPU
# --------------------------------------------------------------------------------------------

class MTPTrainHead(torch.nn.Module):
    """Our ``mamba2`` MTP layout (replayssm.models.mtp; parameter names are the checkpoint's
    without the ``mtp.`` prefix), trainable, holding transformers' Mamba-2 modules:
    ``g = norm(block(fc([n_e(E x_{t+1}) ; n_h(h_t)])))``, logits ``lm_head(g)`` (shared).

    :meth:`depth1` runs the block over the pairs ``t = 0..S-1`` (the quadratic SSD form of one
    window, ``mamba_scan``); :meth:`depth2` runs, for every ``t`` at once, the *second* draft's
    step exactly as the drafter does at inference: one more pair ``(g_t, x_{t+2})`` on top of
    the block's state after pair ``t`` (``mamba_branch``)."""

    def __init__(self, target):
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Block, Mamba2RMSNorm

        super().__init__()
        c = target.config
        D, eps = c.hidden_size, c.layer_norm_epsilon
        self.fc = torch.nn.Linear(2 * D, D, bias=False)
        self.pre_fc_norm_embedding = Mamba2RMSNorm(D, eps=eps)
        self.pre_fc_norm_hidden = Mamba2RMSNorm(D, eps=eps)
        self.layers = torch.nn.ModuleList([Mamba2Block(c, layer_idx=0)])
        self.norm = Mamba2RMSNorm(D, eps=eps)
        with torch.no_grad():  # start from the target's last block and output norm; fc = [I, I]
            last = target.backbone.layers[c.num_hidden_layers - 1]
            self.layers[0].load_state_dict(last.state_dict())
            self.norm.weight.copy_(target.backbone.norm_f.weight)
            self.fc.weight.copy_(torch.cat([torch.eye(D), torch.eye(D)], 1))

    def _u(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden.to(emb.dtype))], -1))

    def depth1(self, emb_next: torch.Tensor, hidden: torch.Tensor):
        """``g [B, S, D]`` of the pairs ``(h_t, x_{t+1})`` and what :meth:`depth2` needs."""
        blk = self.layers[0]
        u = self._u(emb_next, hidden)
        y, aux = mamba_scan(blk.mixer, blk.norm(u))
        return self.norm(u + y), aux

    def depth2(self, emb2: torch.Tensor, g: torch.Tensor, aux) -> torch.Tensor:
        """``g2 [B, S, D]``: row ``t`` is the output for the pair ``(g_t, x2_t)`` placed right
        after pair ``t`` (``emb2``: the embedding of the second draft's input token)."""
        blk = self.layers[0]
        u2 = self._u(emb2, g)
        return self.norm(u2 + mamba_branch(blk.mixer, blk.norm(u2), aux))

    def forward(self, emb_next: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.depth1(emb_next, hidden)[0]


def _mixer_in(mixer, hs: torch.Tensor):
    """``(z, xBC, dt)`` of a transformers Mamba2Mixer's input projection."""
    inter, conv = mixer.intermediate_size, mixer.conv_dim
    z, xbc, dt = mixer.in_proj(hs).split([inter, conv, mixer.num_heads], -1)
    dt = F.softplus(dt + mixer.dt_bias)
    lo, hi = mixer.time_step_limit
    return z, xbc, dt.clamp(min=lo, max=hi) if (lo > 0 or hi != float("inf")) else dt


def _mixer_split(mixer, xc: torch.Tensor):
    B_, S_ = xc.shape[:2]
    G, n, H = mixer.n_groups, mixer.ssm_state_size, mixer.num_heads
    x, Bm, Cm = xc.split([mixer.intermediate_size, G * n, G * n], -1)
    return x.reshape(B_, S_, H, -1), Bm.reshape(B_, S_, G, n), Cm.reshape(B_, S_, G, n)


def _readout(mixer, Cq, Bk, xk, dt, cum):
    """``[B, S, H, P]``: query ``t`` reads the state after token ``t`` (keys ``s <= t``):
    ``sum_s exp(cum_t - cum_s) dt_s (C_t . B_s) x_s`` (decays as exponentials of segment sums)."""
    H, G = mixer.num_heads, mixer.n_groups
    S_ = Cq.shape[1]
    scores = torch.einsum("btgn,bsgn->bgts", Cq, Bk).repeat_interleave(H // G, 1)   # [B, H, t, s]
    seg = cum.transpose(1, 2)[:, :, :, None] - cum.transpose(1, 2)[:, :, None, :]
    causal = torch.ones(S_, S_, dtype=torch.bool, device=Cq.device).tril()
    decay = torch.exp(torch.where(causal, seg, torch.full_like(seg, -torch.inf)))
    M = scores * decay * dt.transpose(1, 2)[:, :, None, :]
    return torch.einsum("bhts,bshp->bthp", M, xk)


def mamba_scan(mixer, hs: torch.Tensor):
    """A transformers Mamba2Mixer over ``hs [B, S, D]`` (from a zero state) in the quadratic
    form; returns ``(out [B, S, D], aux)`` (aux: the per-token tensors of the state)."""
    B_, S_, _ = hs.shape
    z, xbc, dt = _mixer_in(mixer, hs)
    W = mixer.conv_kernel_size
    xc = F.silu(F.conv1d(xbc.transpose(1, 2), mixer.conv1d.weight, mixer.conv1d.bias, padding=W - 1,
                         groups=mixer.conv_dim)[..., :S_].transpose(1, 2))
    x, Bm, Cm = _mixer_split(mixer, xc)
    A = -torch.exp(mixer.A_log.float())
    cum = torch.cumsum(dt * A, 1)                                                   # [B, S, H]
    y = _readout(mixer, Cm, Bm, x, dt, cum) + mixer.D[:, None] * x
    out = mixer.out_proj(mixer.norm(y.reshape(B_, S_, -1), z))
    return out, (xbc, x, Bm, dt, cum)


def mamba_branch(mixer, hs2: torch.Tensor, aux) -> torch.Tensor:
    """Row ``t``: the mixer's output for input ``hs2[:, t]`` placed right after token ``t`` of
    the sequence ``aux`` describes (its conv window: tokens ``t-W+2..t``; its state: after
    token ``t``): ``y = a (C . S_t) + dt (C . B) x + D x`` with ``a = exp(A dt)``."""
    xbc1, x1, B1, dt1, cum1 = aux
    S_ = hs2.shape[1]
    z, xbc, dt = _mixer_in(mixer, hs2)
    W = mixer.conv_kernel_size
    w = mixer.conv1d.weight                                                         # [C, 1, W]
    prefix = F.conv1d(xbc1.transpose(1, 2), w[..., :W - 1], None, padding=W - 2,
                      groups=mixer.conv_dim)[..., :S_].transpose(1, 2)
    bias = mixer.conv1d.bias if mixer.conv1d.bias is not None else 0.0
    xc = F.silu(prefix + w[:, 0, W - 1] * xbc + bias)
    x, Bm, Cm = _mixer_split(mixer, xc)
    A = -torch.exp(mixer.A_log.float())
    H, G = mixer.num_heads, mixer.n_groups
    own = torch.einsum("btgn,btgn->btg", Cm, Bm).repeat_interleave(H // G, -1)        # [B, S, H]
    y = (torch.exp(dt * A)[..., None] * _readout(mixer, Cm, B1, x1, dt1, cum1)
         + (dt * own)[..., None] * x + mixer.D[:, None] * x)
    return mixer.out_proj(mixer.norm(y.reshape(*hs2.shape[:2], -1), z))


def check_mtp_forms(target) -> float:
    """float64: :meth:`MTPTrainHead.depth1` equals transformers' Mamba2Block over the pairs,
    and :meth:`MTPTrainHead.depth2` row ``t`` equals the block run over pairs ``0..t`` then
    the branch pair (the drafter's second step); returns the largest relative error."""
    import copy

    head = MTPTrainHead(target).double()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
        head.layers[0].mixer.A_log.copy_(torch.log(torch.rand_like(head.layers[0].mixer.A_log) * 4 + 0.5))
    g = torch.Generator().manual_seed(0)
    D = target.config.hidden_size
    emb, hid, emb2 = (torch.randn(2, 19, D, generator=g, dtype=torch.float64) for _ in range(3))
    errs = []
    with torch.no_grad():
        gd, aux = head.depth1(emb, hid)
        blk = copy.deepcopy(head.layers[0])
        u = head._u(emb, hid)
        ref = head.norm(blk(u))
        errs.append(float((gd - ref).norm() / ref.norm()))
        g2 = head.depth2(emb2, gd, aux)
        u2 = head._u(emb2, gd)
        for t in (0, 1, 5, 18):
            seq = torch.cat([u[:, :t + 1], u2[:, t:t + 1]], 1)
            want = head.norm(blk(seq))[:, -1]
            errs.append(float((g2[:, t] - want).norm() / want.norm()))
    err = max(errs)   # transformers' RMSNorms compute in float32: ~1e-7 is the floor here
    assert err < 1e-6, f"MTP training forms disagree with transformers' block: rel err {err:.3e}"
    return err


def target_hidden(target, w: torch.Tensor, batch: int = 16, dtype=torch.float32) -> torch.Tensor:
    """The frozen target's final-normed hidden states (the LM head's input) of windows
    ``w [N, S+1]`` -> ``[N, S+1, D]`` in ``dtype``."""
    out = torch.empty(w.shape[0], w.shape[1], target.config.hidden_size, dtype=dtype)
    with torch.no_grad():
        for i in range(0, w.shape[0], batch):
            out[i:i + batch] = target.backbone(w[i:i + batch].long(), use_cache=False).last_hidden_state.to(dtype)
    return out


def mtp_batch_losses(target, head, w: torch.Tensor, h: torch.Tensor, depth2: float = 0.0) -> dict:
    """Losses of the head on windows ``w [B, S+1]`` (``x_0..x_S``) with the target's hidden
    states ``h [B, S+1, D]``.  Depth 1: pair ``t`` = ``(h_t, x_{t+1})``, ``t < S``, scored
    against the target's own distribution after ``x_{t+1}`` (soft cross-entropy = KL + the
    target's entropy); also the data cross-entropy on the next-next bytes and the top-1
    agreement with the target.  Depth 2 (weight ``depth2``): the second draft's step, pair
    ``(g_t, x_{t+2})`` right after pair ``t``, against the target after ``x_{t+2}``."""
    w, h = w.long(), h.float()
    S = w.shape[1] - 1
    with torch.no_grad():
        p_t = torch.softmax(target.lm_head(h[:, 1:]).float(), -1)           # target after x_{t+1}
        emb = target.backbone.embeddings(w[:, 1:])
    g, aux = head.depth1(emb, h[:, :-1])
    logq = torch.log_softmax(target.lm_head(g).float(), -1)                 # [B, S, V]
    soft = -(p_t * logq).sum(-1).mean()
    ent = -(p_t * torch.log(p_t.clamp(min=1e-30))).sum(-1).mean()
    out = {"loss": soft, "kl": soft - ent,
           "data_ce": F.cross_entropy(logq[:, :-1].reshape(-1, logq.shape[-1]), w[:, 2:].reshape(-1)),
           "agree": (logq.argmax(-1) == p_t.argmax(-1)).float().mean()}
    if depth2 > 0:
        with torch.no_grad():
            emb2 = F.pad(target.backbone.embeddings(w[:, 2:]), (0, 0, 0, 1))  # x_{t+2}; row S-1 unused
        g2 = head.depth2(emb2, g, aux)[:, :S - 1]
        logq2 = torch.log_softmax(target.lm_head(g2).float(), -1)
        p2 = p_t[:, 1:]                                                      # target after x_{t+2}
        soft2 = -(p2 * logq2).sum(-1).mean()
        ent2 = -(p2 * torch.log(p2.clamp(min=1e-30))).sum(-1).mean()
        out.update(loss=soft + depth2 * soft2, kl2=soft2 - ent2,
                   agree2=(logq2.argmax(-1) == p2.argmax(-1)).float().mean())
    return out


@torch.no_grad()
def mtp_evaluate(target, head, windows: torch.Tensor, hidden: torch.Tensor, batch_size: int) -> dict:
    head.eval()
    tot: dict = {}
    for i in range(0, windows.shape[0], batch_size):
        r = mtp_batch_losses(target, head, windows[i:i + batch_size], hidden[i:i + batch_size], depth2=1.0)
        for k, v in r.items():
            tot[k] = tot.get(k, 0.0) + float(v) * min(batch_size, windows.shape[0] - i)
    head.train()
    return {k: v / windows.shape[0] for k, v in tot.items()}


def plot_mtp(log: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    tr, va = log["train"], log["val"]
    ax.plot([r["step"] for r in tr], [r["kl"] for r in tr], lw=1, alpha=0.8, label="train KL to the target (running mean)")
    ax.plot([r["step"] for r in va], [r["kl"] for r in va], "o-", ms=3, label="val KL (held-out files)")
    ax.set_xlabel("step")
    ax.set_ylabel("KL(target || MTP) of byte t+2 (nats)")
    ax2 = ax.twinx()
    ax2.plot([r["step"] for r in va], [r["agree"] for r in va], "s--", ms=3, color="tab:green",
             label="val top-1 agreement with the target (draft 1)")
    if "agree2" in va[0]:
        ax2.plot([r["step"] for r in va], [r["agree2"] for r in va], "^:", ms=3, color="tab:olive",
                 label="val top-1 agreement, draft 2 (its own g as hidden)")
    ax2.set_ylabel("top-1 agreement")
    ax2.set_ylim(0, 1)
    ax.set_title(f"MTP head of tiny-mamba2: {log['params'] / 1e6:.2f}M params, CPU ({log['threads']} threads)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def train_mtp(args) -> dict:
    """Train the MTP head of the model in ``--target`` (frozen) and write it into ``--out``
    (default: the target directory): ``mtp.safetensors`` (``mtp.*`` tensors, ``--save-dtype``),
    ``num_nextn_predict_layers`` in ``config.json``, ``mtp_train_log.json``, ``mtp_loss.png``."""
    from safetensors.torch import save_file
    from transformers import Mamba2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    t_start = time.time()
    torch.manual_seed(args.seed)
    install_fast_scan()
    scan_err = check_fast_scan()
    tdir = Path(args.target)
    out = Path(args.out) if args.out != "runs/tiny" else tdir
    out.mkdir(parents=True, exist_ok=True)
    target = Mamba2ForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    corpus = load_corpus(Path(args.corpus) if args.corpus else None, args.stdlib)
    man = corpus["manifest"]
    train_tok = to_tokens(corpus["train"], [n for _, n in man["files"]["train"]])
    val_tok = to_tokens(corpus["val"], [n for _, n in man["files"]["val"]])
    S, B = args.seq_len, args.batch_size
    val_windows = fixed_windows(val_tok, S, args.eval_windows)
    forms_err = check_mtp_forms(target)
    head = MTPTrainHead(target)
    n_params = count_params(head)
    print(f"[mtp] target {tdir}; head {n_params:,} parameters; corpus train {train_tok.numel():,} tokens, "
          f"val {val_tok.numel():,}; fast-scan check {scan_err:.1e}, MTP forms check {forms_err:.1e}; "
          f"{torch.get_num_threads()} threads", flush=True)
    # the frozen target runs once per window: its hidden states are computed up front (float16)
    gen = torch.Generator().manual_seed(args.seed + 2)
    starts = torch.randint(0, train_tok.numel() - (S + 1), (args.mtp_windows,), generator=gen)
    train_windows = train_tok[starts[:, None] + torch.arange(S + 1)]
    t_pre = time.time()
    val_hidden = target_hidden(target, val_windows)
    cache = Path(args.mtp_hidden_cache) if args.mtp_hidden_cache else None
    key = {"target": hashlib.sha256((tdir / "model.safetensors").read_bytes()).hexdigest(),
           "windows": args.mtp_windows, "seq_len": S, "seed": args.seed, "corpus": man["sha256"]["train"]}
    if cache is not None and cache.exists() and torch.load(cache / "key.pt") == key:
        train_hidden = torch.load(cache / "hidden.pt")
    else:
        train_hidden = target_hidden(target, train_windows, dtype=torch.float16)
        if cache is not None:
            cache.mkdir(parents=True, exist_ok=True)
            torch.save(train_hidden, cache / "hidden.pt")
            torch.save(key, cache / "key.pt")
    pre_s = time.time() - t_pre
    print(f"[mtp] target hidden states of {args.mtp_windows} training windows ({train_windows.numel():,} tokens) "
          f"in {pre_s:.0f} s", flush=True)
    decay = [p for n, p in head.named_parameters() if p.dim() >= 2 and "conv1d" not in n]
    no_decay = [p for n, p in head.named_parameters() if not (p.dim() >= 2 and "conv1d" not in n)]
    lr = args.lr or 1e-3
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    log = {"name": "mtp", "target": str(tdir), "params": n_params, "args": vars(args), "threads": torch.get_num_threads(),
           "forms_check_rel_err": forms_err,
           "torch": torch.__version__, "lr_peak": lr, "train": [], "val": [], "precompute_s": pre_s,
           "train_windows": int(args.mtp_windows), "train_tokens": int(train_windows.numel()),
           "corpus": {k: man[k] for k in ("python", "rule", "bytes", "sha256")}}
    log["val"].append({"step": 0, **mtp_evaluate(target, head, val_windows, val_hidden, B), "time_s": 0.0})
    print(f"[mtp] step 0 val KL {log['val'][-1]['kl']:.4f} agree {log['val'][-1]['agree']:.4f}", flush=True)
    total, warmup = args.steps, min(args.warmup, max(1, args.steps // 10))
    run: dict = {}
    t0 = time.time()
    step = 0
    while step < total:
        if args.time_budget and step == 5:
            t_probe = time.time()
        if args.time_budget and step == 25:     # fix the step count from the pace of steps 5..25
            per = (time.time() - t_probe) / 20
            evals = max(1, total // args.eval_every)
            left = args.time_budget - (time.time() - t_start)
            total = max(step + 1, min(args.steps, step + int(0.9 * left / per) - evals))
            warmup = min(args.warmup, max(1, total // 10))
            log["step_time_probe_s"] = per
            print(f"[mtp] {per:.2f} s/step -> {total} steps (budget {args.time_budget:.0f} s)", flush=True)
        cur = lr_at(step, total, lr, warmup)
        for gp in opt.param_groups:
            gp["lr"] = cur
        idx = torch.randint(0, args.mtp_windows, (B,), generator=gen)
        r = mtp_batch_losses(target, head, train_windows[idx], train_hidden[idx], args.mtp_depth2)
        opt.zero_grad(set_to_none=True)
        r["loss"].backward()
        gnorm = torch.nn.utils.clip_grad_norm_(head.parameters(), args.grad_clip)
        opt.step()
        step += 1
        for k, v in r.items():
            run[k] = run.get(k, 0.0) + float(v.detach())
        run["n"] = run.get("n", 0) + 1
        if step % args.log_every == 0 or step == total:
            n = run.pop("n")
            log["train"].append({"step": step, **{k: v / n for k, v in run.items()}, "lr": cur,
                                 "grad_norm": float(gnorm), "time_s": time.time() - t0})
            run = {}
            if not math.isfinite(log["train"][-1]["loss"]):
                raise RuntimeError(f"loss is {log['train'][-1]['loss']} at step {step}")
        if step % args.eval_every == 0 or step == total:
            log["val"].append({"step": step, **mtp_evaluate(target, head, val_windows, val_hidden, B),
                               "time_s": time.time() - t0})
            v = log["val"][-1]
            print(f"[mtp] step {step}/{total} train KL {log['train'][-1]['kl']:.4f} val KL {v['kl']:.4f} "
                  f"agree {v['agree']:.4f} (2nd draft: KL {v['kl2']:.4f} agree {v['agree2']:.4f}) "
                  f"data CE {v['data_ce']:.4f} ({time.time() - t0:.0f} s)", flush=True)
        if args.time_budget and time.time() - t_start > 1.15 * args.time_budget:
            log["stopped_early"] = True
            print(f"[mtp] hard stop at step {step}: over the time budget (a shared machine)", flush=True)
            break
    log.update(steps=step, train_time_s=time.time() - t0, tokens_seen=step * B * S)
    # round to the shipped dtype and measure again on the rounded weights
    if args.save_dtype == "bfloat16":
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    log["final"] = {**mtp_evaluate(target, head, val_windows, val_hidden, B), "eval_windows": int(val_windows.shape[0]),
                    "seq_len": S, "weights": args.save_dtype}
    sdt = torch.bfloat16 if args.save_dtype == "bfloat16" else torch.float32
    save_file({f"mtp.{k}": v.detach().to(sdt).contiguous() for k, v in head.state_dict().items()},
              str(out / "mtp.safetensors"), metadata={"format": "pt"})
    cfg_path = out / "config.json"
    if not cfg_path.exists():
        import shutil
        for fn in os.listdir(tdir):
            if not (tdir / fn).is_dir() and not (out / fn).exists():
                shutil.copy(tdir / fn, out / fn)
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    log["check_vs_replayssm"] = check_mtp_export(out, target, head, val_windows[:2].long())
    log["wall_time_s"] = time.time() - t_start
    (out / "mtp_train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    plot_mtp(log, Path(args.mtp_plot) if args.mtp_plot else out / "mtp_loss.png")
    f = log["final"]
    print(f"[mtp] done: {step} steps in {log['train_time_s']:.0f} s; val KL {f['kl']:.4f}, agreement "
          f"{f['agree']:.4f}, data CE {f['data_ce']:.4f} -> {out}", flush=True)
    return log


@torch.no_grad()
def check_mtp_export(out: Path, target, head, w: torch.Tensor) -> float:
    """The exported head loaded by replayssm (``load_model(..., mtp=True)``) gives the trained
    module's outputs (float32; returns the max abs difference of g)."""
    from replayssm.models import load_model

    ours = load_model(str(out), dtype="float32", mtp=True)
    h = target.backbone(w, use_cache=False).last_hidden_state
    want = head(target.backbone.embeddings(w[:, 1:]), h[:, :-1])
    got = ours.mtp(w[:, 1:], h[:, :-1].contiguous())
    err = float((got - want).abs().max())
    assert err < 1e-3 * float(want.abs().max()), f"exported MTP head differs from the trained one: {err:.3e}"
    return err


# --------------------------------------------------------------------------------------------
# report (CPU): samples and draft agreement
# --------------------------------------------------------------------------------------------

def report(args) -> dict:
    from transformers import Mamba2ForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    assets = Path(args.report)
    tdir, ddir = assets / "tiny-mamba2", assets / "tiny-mamba2-draft"
    res = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    t0 = time.time()
    target = Mamba2ForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    draft = Mamba2ForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    res["load_s"] = time.time() - t0
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tdir / "tokenizer.json"))
    res["params"] = {"target": count_params(target), "draft": count_params(draft)}
    res["samples"] = []
    for prompt in ["def fibonacci(n):", "import os\n", "class Stack:\n", "    for i in range(10):\n"]:
        ids = torch.tensor([tok(prompt)["input_ids"]])  # [<eos>] + prompt bytes
        assert ids[0, 0].item() == EOS_ID and ids[0, 1:].tolist() == list(prompt.encode())
        for name, m in (("target", target), ("draft", draft)):
            t0 = time.time()
            with torch.no_grad():
                outp = m.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                  eos_token_id=EOS_ID, pad_token_id=EOS_ID)
            dt = time.time() - t0
            new = outp[0, ids.shape[1]:].tolist()
            text = tok.decode(new)
            assert text == bytes(b for b in new if b < 256).decode("utf-8", "replace")
            res["samples"].append({"model": name, "prompt": prompt, "text": text, "new_tokens": len(new),
                                   "seconds": dt, "tokens_per_s": len(new) / dt})
            print(f"--- {name} | {prompt!r} | {len(new)} tokens in {dt:.2f}s "
                  f"({len(new) / dt:.0f} tok/s)\n{prompt}{text}\n", flush=True)
    # greedy agreement on held-out files (teacher forcing over the same snippet)
    corpus = load_corpus(Path(args.corpus) if args.corpus else None, args.stdlib)
    val = corpus["val"]
    n = args.agree_bytes
    starts = [int(i * (len(val) - n) / max(1, args.agree_snippets - 1)) for i in range(args.agree_snippets)]
    agree, total, tl, dl = 0, 0, 0.0, 0.0
    with torch.no_grad():
        for s in starts:
            ids = torch.tensor([list(val[s:s + n])])
            lt = target(input_ids=ids, use_cache=False).logits[0, :-1].float()
            ld = draft(input_ids=ids, use_cache=False).logits[0, :-1].float()
            y = ids[0, 1:]
            agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
            total += y.numel()
            tl += F.cross_entropy(lt, y, reduction="sum").item()
            dl += F.cross_entropy(ld, y, reduction="sum").item()
    res["agreement"] = {"rate": agree / total, "positions": total, "snippets": len(starts),
                        "snippet_bytes": n, "target_loss": tl / total, "draft_loss": dl / total,
                        "source": "held-out stdlib files (val split), evenly spaced snippets"}
    print(f"greedy agreement draft vs target: {agree / total:.4f} over {total} positions "
          f"(target loss {tl / total:.3f}, draft loss {dl / total:.3f} nats/byte)", flush=True)
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(res, indent=1) + "\n")
    return res


def acceptance_report(args) -> dict:
    """Mean accepted length of greedy speculation (CPU, replayssm's engine, float32) with the
    target's MTP head, the shipped draft model and prompt lookup, on held-out files: prompts
    are ``--acc-prompts`` evenly spaced ``--acc-prompt-bytes``-byte snippets of the val split,
    each continued for ``--acc-new-tokens`` bytes with ``--acc-drafts`` drafts per step."""
    from replayssm import LLM, SamplingParams, SpeculativeConfig

    torch.set_num_threads(max(1, torch.get_num_threads()))
    assets = Path(args.acceptance)
    tdir, ddir = assets / "tiny-mamba2", assets / "tiny-mamba2-draft"
    corpus = load_corpus(Path(args.corpus) if args.corpus else None, args.stdlib)
    val, n, m = corpus["val"], args.acc_prompt_bytes, args.acc_prompts
    prompts = []
    for i in range(m):
        s0 = int(i * (len(val) - n) / max(1, m - 1))
        s0 = val.rfind(b"\n", 0, s0) + 1          # start at a line
        prompts.append([EOS_ID] + list(val[s0:s0 + n]))
    k = args.acc_drafts
    configs = {
        "mtp": SpeculativeConfig("mtp", num_tokens=k),
        "mtp-tree": SpeculativeConfig("mtp", num_tokens=k, tree="topk", tree_width=2),
        "draft": SpeculativeConfig("draft", num_tokens=k, draft_model=str(ddir)),
        "ngram": SpeculativeConfig("ngram", num_tokens=k),
    }
    params = SamplingParams(max_tokens=args.acc_new_tokens, ignore_eos=True)
    res = {"prompts": m, "prompt_bytes": n, "new_tokens": args.acc_new_tokens, "drafts": k,
           "source": "held-out stdlib files (val split), evenly spaced snippets", "rows": {}}
    plain = LLM(str(tdir), device="cpu", dtype="float32", max_num_seqs=m).generate(prompts, params)
    for name, sp in configs.items():
        t0 = time.time()
        llm = LLM(str(tdir), device="cpu", dtype="float32", max_num_seqs=m, speculative=sp,
                  buffer_size=max(16, 2 * sp.verify_tokens))
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], name
        acc = sum(sum(o.accepted_lengths) for o in outs)       # tokens per verify step, summed
        steps = sum(len(o.accepted_lengths) for o in outs)
        lens = [a for o in outs for a in o.accepted_lengths]
        res["rows"][name] = {"mean_accepted_length": acc / max(1, steps), "verify_steps": steps,
                             "drafted": sum(o.num_drafted for o in outs), "seconds": time.time() - t0,
                             "nodes_per_step": sp.verify_tokens,
                             # share of steps whose drafts 1..j were all accepted
                             "depth_accepted": [sum(a > j for a in lens) / max(1, steps) for j in range(1, k + 1)]}
        print(f"{name:<9} mean accepted length {acc / max(1, steps):.3f} over {steps} steps "
              f"({sp.verify_tokens} tokens verified per step; drafts 1..j accepted: "
              f"{[round(x, 3) for x in res['rows'][name]['depth_accepted']]}; {time.time() - t0:.1f} s)", flush=True)
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(res, indent=1) + "\n")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODEL_PRESETS), default="target")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=6000, help="training steps (upper bound with --time-budget)")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds for the whole run; steps are cut to fit after a 30-step timing probe")
    ap.add_argument("--out", default="runs/tiny")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.0, help="peak LR (default: per model)")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--corpus", default=None, help="packed corpus folder (from --pack-corpus)")
    ap.add_argument("--stdlib", default=None, help="stdlib folder (default: this Python's)")
    ap.add_argument("--pack-corpus", default=None, metavar="DIR", help="write the corpus to DIR and exit")
    ap.add_argument("--smoke", action="store_true", help="tiny model, few CPU steps (for CI)")
    ap.add_argument("--report", default=None, metavar="ASSETS",
                    help="load ASSETS/tiny-mamba2{,-draft}, print samples and draft agreement (CPU)")
    ap.add_argument("--report-json", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--agree-bytes", type=int, default=1024)
    ap.add_argument("--agree-snippets", type=int, default=8)
    ap.add_argument("--stage", choices=["model", "mtp"], default="model",
                    help="model: train --model from scratch; mtp: train the MTP head of --target (frozen, CPU)")
    ap.add_argument("--target", default=str(Path(__file__).resolve().parent.parent / "replayssm/assets/tiny-mamba2"),
                    help="mtp stage: the target model directory (the head is written there unless --out)")
    ap.add_argument("--mtp-plot", default=None, help="mtp stage: loss curve PNG (default: OUT/mtp_loss.png)")
    ap.add_argument("--acceptance", default=None, metavar="ASSETS",
                    help="mean accepted length of MTP vs draft vs n-gram speculation on held-out files (CPU)")
    ap.add_argument("--acc-prompts", type=int, default=16)
    ap.add_argument("--acc-prompt-bytes", type=int, default=256)
    ap.add_argument("--acc-new-tokens", type=int, default=128)
    ap.add_argument("--acc-drafts", type=int, default=4)
    ap.add_argument("--mtp-windows", type=int, default=6000,
                    help="mtp stage: training windows whose target hidden states are computed up front")
    ap.add_argument("--mtp-depth2", type=float, default=0.5,
                    help="mtp stage: weight of the second draft's loss (its step as the drafter runs it)")
    ap.add_argument("--mtp-hidden-cache", default=None,
                    help="mtp stage: folder to keep the target's hidden states in between runs")
    args = ap.parse_args(argv)

    if args.pack_corpus:
        m = pack_corpus(Path(args.pack_corpus), args.stdlib)
        print(json.dumps({k: m[k] for k in ("python", "bytes", "sha256")}, indent=1))
        return 0
    if args.report:
        report(args)
        return 0
    if args.acceptance:
        acceptance_report(args)
        return 0
    if args.stage == "mtp":
        # the mtp stage's own defaults for settings left at the model stage's
        for name, model_default, mtp_default in (("seq_len", 512, 256), ("batch_size", 64, 16),
                                                 ("eval_windows", 128, 48), ("eval_every", 500, 50),
                                                 ("log_every", 25, 5), ("warmup", 200, 20)):
            if getattr(args, name) == model_default:
                setattr(args, name, mtp_default)
        if args.smoke:
            if args.out == "runs/tiny":
                ap.error("--stage mtp --smoke needs --out (it must not overwrite the shipped head)")
            args.steps, args.seq_len, args.batch_size = min(args.steps, 3), 32, 2
            args.eval_every, args.eval_windows, args.log_every, args.warmup = 3, 2, 1, 1
            args.mtp_windows = 4
        train_mtp(args)
        return 0
    if args.smoke:
        args.model = "smoke"
        args.device = "cpu"
        args.steps = min(args.steps, 6)
        args.seq_len = min(args.seq_len, 64)
        args.batch_size = min(args.batch_size, 4)
        args.eval_every = args.steps
        args.eval_windows = 4
        args.log_every = 2
        args.warmup = 2
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
