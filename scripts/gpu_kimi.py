"""GPU check and decode timing of Kimi-Linear (KDA + MLA + MoE) with the KDA Triton kernels.

1. Kernels: ``replay_decode``, ``replay_verify`` (T=4) and ``tree_verify`` (N=4) of
   ``replayssm.kernels.kda`` against the reference ops (``replayssm.ops.kda.naive``, float64
   copies of the caches, re-synced to the kernel's caches after every step) at B=64, 16
   value heads of 128 channels, ring L=16, bf16 inputs and ring: max |error| of the outputs
   and of every cache tensor after each step; and ``kv_verify`` (the KV-only form over
   pages of 16 entries) after 40 decode steps, T=1 and T=4.
2. Greedy parity: a small random Kimi-Linear (transformers' KimiLinearForCausalLM, saved and
   loaded) through the engine on CUDA in float32 (kernels, CUDA graphs) in every decode mode,
   tokens against the engine on CPU in float32 (reference ops).
3. Decode timing, bf16, B=1 and 64 (engine, CUDA graphs): replay with the KDA kernels
   against replay with the KDA reference ops (every other layer identical) and against the
   recurrent mode (standard decoding); tokens/s of the decode phase.

    PYTHONPATH=.:tests/models python3 scripts/gpu_kimi.py

Prints a short table; writes ``$OUT/gpu_kimi.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "models"))
from hf_utils import save_tiny  # noqa: E402
from test_kimi_linear import tiny_kimi  # noqa: E402

from replayssm import LLM, SamplingParams  # noqa: E402
from replayssm.cache.buffers import KDABuffers  # noqa: E402
from replayssm.cache.ring import RingIndex  # noqa: E402
from replayssm.cache.tree import gather_path, path_to  # noqa: E402
from replayssm.kernels import kda as KK  # noqa: E402
from replayssm.kernels.dispatch import ops_for  # noqa: E402
from replayssm.layers.kda import KimiDeltaAttention  # noqa: E402
from replayssm.ops.kda import naive as NK  # noqa: E402

DEV = "cuda"
RESULTS: dict = {}
#: kernel check sizes: rows, key heads, value heads, K, V, ring L, slots
KSIZES = (64, 16, 16, 128, 128, 16, 80)


# ---------------------------------------------------------------------------- 1. kernels
def kernel_check() -> None:
    g = torch.Generator().manual_seed(0)
    Bt, H, HV, K, V, L, P = KSIZES
    ring = RingIndex(P - 1, L, torch.device(DEV))
    buf = KDABuffers.allocate(P - 1, L, H, HV, K, V, dtype=torch.bfloat16, device=DEV)
    buf.state.copy_(torch.randn(buf.state.shape, generator=g))
    slots = (torch.randperm(P - 1, generator=g)[:Bt] + 1).to(DEV)
    ring.start[1:] = torch.randint(0, L, (P - 1,), generator=g).to(DEV)
    buf.u.copy_(torch.randn(buf.u.shape, generator=g))
    buf.k.copy_(torch.nn.functional.normalize(torch.randn(buf.k.shape, generator=g), dim=-1))
    buf.g.copy_(-torch.rand(buf.g.shape, generator=g) * 0.3)
    ref = KDABuffers(*(t.double().clone() for t in (buf.state, buf.u, buf.k, buf.g)))

    def inputs(T=None):
        lead = (Bt,) if T is None else (Bt, T)
        q, k = (torch.randn(*lead, H, K, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
        v = torch.randn(*lead, HV, V, generator=g).to(DEV, torch.bfloat16)
        gg = (-torch.nn.functional.softplus(torch.randn(*lead, HV, K, generator=g)) * 0.3).to(DEV)
        beta = torch.sigmoid(torch.randn(*lead, HV, generator=g)).to(DEV, torch.bfloat16)
        return q, k, v, gg, beta

    def err(a, b):
        return float((a.double() - b.double()).abs().max())

    out = {}
    # 10 decodes fill the rings (h = 10 of L = 16), then every form; the T = 4 verify flushes
    for step, kind in enumerate(["fill"] * 10 + ["decode", "verify", "tree", "decode"]):
        if kind in ("fill", "decode"):
            x = inputs()
            plan = ring.plan_decode(slots)
            y_ref = NK.replay_decode(ref, plan, *(t.double() for t in x))
            y = KK.replay_decode(buf, plan, *x)
            ring.commit(plan)
        else:
            T = 4
            x = inputs(T)
            plan = ring.plan_verify(slots, T, kind)
            if kind == "tree":
                parent = torch.tensor([-1, 0, 0, 1], device=DEV)
                y_ref = NK.tree_verify(ref, plan, parent, *(t.double() for t in x))
                y = KK.tree_verify(buf, plan, parent, *x)
                path, n = path_to(parent, torch.full((Bt,), 3, device=DEV))
                acc = torch.minimum(torch.randint(0, T + 1, (Bt,), generator=g).to(DEV), n)
                for b in (buf, ref):
                    gather_path(b.ring_tensors(), plan, path, acc)
            else:
                y_ref = NK.replay_verify(ref, plan, *(t.double() for t in x))
                y = KK.replay_verify(buf, plan, *x)
                acc = torch.randint(0, T + 1, (Bt,), generator=g).to(DEV)
            ring.commit(plan, acc)
        if kind != "fill":
            e = {"y": err(y, y_ref), **{n: err(getattr(buf, n), getattr(ref, n)) for n in ("state", "u", "k", "g")}}
            out[f"{kind}@{step}"] = e
            print(f"kernel {kind:>7} (step {step}): max|err| " + ", ".join(f"{k} {v:.2e}" for k, v in e.items()),
                  flush=True)
        for n in ("state", "u", "k", "g"):   # the next step starts from the kernel's caches: one step's error
            getattr(ref, n).copy_(getattr(buf, n).double())
    RESULTS["kernels"] = out
    kv_check(g)


def kv_check(g) -> None:
    from replayssm.cache.paged import KDAPagedBuffers, PagedIndex

    Bt, H, HV, K, V, _, P = KSIZES
    bs, NB = 16, Bt * 5 + 1
    pidx = PagedIndex(P - 1, bs, NB, 8, torch.device(DEV))
    kv = KDAPagedBuffers.allocate(NB, bs, H, HV, K, V, dtype=torch.bfloat16, device=DEV)
    slots = torch.arange(1, Bt + 1, device=DEV)
    out = {}
    for step in range(42):
        T = 4 if step == 41 else 1
        for s in slots.tolist():
            pidx.reserve(s, int(pidx.length[s]) + T)
        pplan = pidx.plan(slots, T)
        q, k = (torch.randn(Bt, T, H, K, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
        v = torch.randn(Bt, T, HV, V, generator=g).to(DEV, torch.bfloat16)
        gg = (-torch.nn.functional.softplus(torch.randn(Bt, T, HV, K, generator=g)) * 0.3).to(DEV)
        beta = torch.sigmoid(torch.randn(Bt, T, HV, generator=g)).to(DEV, torch.bfloat16)
        ref = KDAPagedBuffers(*(t.double().clone() for t in kv.tensors()))
        y_ref = NK.kv_verify(ref, pplan, *(t.double() for t in (q, k, v, gg, beta)))
        y = KK.kv_verify(kv, pplan, q, k, v, gg, beta)
        if step >= 40:
            e = {"y": float((y.double() - y_ref).abs().max()),
                 **{n: float((a.double() - b).abs().max()) for n, a, b in zip(("u", "k", "g"), kv.tensors(),
                                                                              ref.tensors())}}
            out[f"kv T={T}"] = e
            print(f"kernel kv_verify T={T} (context {int(pidx.length[1])}): max|err| "
                  + ", ".join(f"{a} {b:.2e}" for a, b in e.items()), flush=True)
        pidx.commit(pplan, torch.full((Bt,), T, device=DEV))
    RESULTS["kernels"].update(out)


# ---------------------------------------------------------------------------- 2. parity
SMALL = dict(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
             kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, intermediate_size=512,
             moe_intermediate_size=128, num_experts=8, num_experts_per_token=2, n_group=2, topk_group=1,
             linear_head_dim=64, linear_num_heads=4, linear_conv_kernel_dim=4,
             layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
             mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
MEDIUM = dict(vocab_size=4096, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
              kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, intermediate_size=2048,
              moe_intermediate_size=256, num_experts=16, num_experts_per_token=2, n_group=2, topk_group=1,
              linear_head_dim=128, linear_num_heads=8, linear_conv_kernel_dim=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
              mlp_layer_types=["dense"] + ["sparse"] * 7)


def build(cfg: dict, root: str, name: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return save_tiny(tiny_kimi(seed=7, **cfg), os.path.join(root, name))


def parity(root: str) -> None:
    path = build(SMALL, root, "small")
    prompts = [[(7 * i + 3 * j + 1) % 1000 for j in range(5 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=24)
    ref = [o.token_ids for o in LLM(path, dtype="float32", max_seq_len=256).generate(prompts, params)]
    out = {}
    for mode in ("recurrent", "replay", "kv", "auto"):
        try:
            llm = LLM(path, device=DEV, dtype="float32", decode_mode=mode, max_seq_len=256, max_num_seqs=8,
                      auto_threshold=16)
            got = [o.token_ids for o in llm.generate(prompts, params)]
            same = sum(a == b for a, b in zip(got, ref))
            out[mode] = f"{same}/{len(ref)}"
            print(f"parity {mode:>9}: graphs={llm.runner.use_graphs} {same}/{len(ref)} prompts equal the "
                  f"float32 CPU reference", flush=True)
        except Exception as e:   # report and go on
            out[mode] = f"FAILED {type(e).__name__}: {str(e)[:200]}"
            print(f"parity {mode:>9}: {out[mode]}", flush=True)
    RESULTS["parity"] = out


# ---------------------------------------------------------------------------- 3. timing
def _decode_rate(path: str, B: int, mode: str, reference_kda: bool, new: int = 64) -> float:
    orig = KimiDeltaAttention.ops
    if reference_kda:
        KimiDeltaAttention.ops = lambda self: ops_for("kda", "naive")
    try:
        llm = LLM(path, device=DEV, dtype="bfloat16", decode_mode=mode, max_seq_len=256, max_num_seqs=B)
        prompts = [[(11 * i + j) % 4096 for j in range(16)] for i in range(B)]
        llm.generate(prompts, SamplingParams(max_tokens=8))                 # warm-up (graphs)
        times = []
        for n in (1, new + 1):   # the difference removes prefill and the first token (best of 2 runs)
            best = float("inf")
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                llm.generate(prompts, SamplingParams(max_tokens=n))
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            times.append(best)
        return B * new / (times[1] - times[0])
    finally:
        KimiDeltaAttention.ops = orig


def timing(root: str) -> None:
    path = build(MEDIUM, root, "medium")
    out = {}
    for B in (1, 64):
        row = {}
        for name, mode, ref_kda in (("replay+kernels", "replay", False), ("replay+reference", "replay", True),
                                    ("recurrent", "recurrent", False)):
            try:
                row[name] = round(_decode_rate(path, B, mode, ref_kda), 1)
            except Exception as e:
                row[name] = f"FAILED {type(e).__name__}: {str(e)[:200]}"
        k = row.get("replay+kernels")
        for base in ("replay+reference", "recurrent"):
            if isinstance(k, float) and isinstance(row.get(base), float):
                row[f"kernels vs {base}"] = round(k / row[base], 2)
        out[f"B={B}"] = row
        print(f"decode B={B:>3} tok/s: " + ", ".join(f"{a} {b}" for a, b in row.items()), flush=True)
    RESULTS["decode_tokens_per_s"] = out


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    RESULTS["device"] = torch.cuda.get_device_name()
    root = tempfile.mkdtemp()
    kernel_check()
    parity(root)
    timing(root)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_kimi.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
