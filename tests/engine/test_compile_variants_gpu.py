"""A serving engine's prefill batches change size every step: after a first few batches, new
batch sizes and prompt lengths must not compile new Triton kernel variants (each compile is a
stall of seconds for every request in flight).  Skipped without a GPU."""

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _compiled_variants() -> dict:
    """``{kernel name: compiled variants}`` of every Triton kernel in ``replayssm.kernels``."""
    import importlib
    import pkgutil

    import replayssm.kernels as pkg
    from triton.runtime.jit import JITFunction

    out = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name, fn in vars(mod).items():
            if isinstance(fn, JITFunction) and hasattr(fn, "device_caches"):
                out[f"{info.name}.{name}"] = sum(len(c[0]) for c in fn.device_caches.values())
    return out


def _prompts(rng, n, lo, hi, vocab):
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("preset", ["tiny", "nemotron-h-tiny", "qwen3-next-tiny"])
def test_new_prefill_batch_shapes_compile_nothing(preset, tmp_path):
    from replayssm import LLM, SamplingParams
    from replayssm.bench.e2e import _random_model_dir

    d = _random_model_dir(preset, str(tmp_path))
    llm = LLM(d, device="cuda", dtype="bfloat16", decode_mode="replay", max_seq_len=512, max_num_seqs=64)
    vocab = llm.model.config.vocab_size
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1)              # prefill only: the first token comes from its logits
    for n in (1, 4, 9, 16):                         # the first batches: every bucket compiles here
        llm.generate(_prompts(rng, n, 1, 300, vocab), one)
    before = _compiled_variants()
    for n in (2, 3, 5, 7, 13, 17, 27, 32, 41, 64):
        llm.generate(_prompts(rng, n, 1, 400, vocab), one)
    after = _compiled_variants()
    grown = {k: (before.get(k, 0), v) for k, v in after.items() if v > before.get(k, 0)}
    assert not grown, f"prefill batches of new sizes compiled new kernel variants: {grown}"
