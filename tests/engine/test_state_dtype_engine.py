"""``ssm_state_dtype`` through the engine: ``EngineConfig`` validates it, the cache spec and
the memory plan carry it (16-bit states: more slots in the same budget), ``LLM`` builds its
cache with it, and the generate / serve flags (``--ssm-state-dtype``, alias
``--mamba-ssm-cache-dtype``) reach the engine."""

from __future__ import annotations

import pytest
import torch

from replayssm import LLM, SamplingParams
from replayssm.engine import cli
from replayssm.engine.config import EngineConfig

SHIPPED = cli.DEFAULT_MODEL
needs_shipped = pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="shipped model not present")


def test_config_validates_and_carries_the_dtype():
    assert EngineConfig().ssm_state_dtype == "auto"
    ec = EngineConfig(ssm_state_dtype=torch.float16)
    assert ec.ssm_state_dtype == "float16" and ec.cache_spec(64).ssm_state_dtype == "float16"
    assert ec.cache_spec(64).for_draft().ssm_state_dtype == "float16"   # a drafter's states too
    for bad in ("fp8", "float64", 2):
        with pytest.raises(ValueError, match="ssm_state_dtype must be one of"):
            EngineConfig(ssm_state_dtype=bad)


@needs_shipped
def test_16bit_states_give_more_slots_in_the_same_budget():
    kw = dict(max_seq_len=256, decode_mode="replay")
    probe = LLM(str(SHIPPED), max_num_seqs=1, **kw)
    budget = 6 * probe.plan.memory.need(256 + 1)
    probe.close()
    f32 = LLM(str(SHIPPED), memory_budget=budget, **kw)
    b16 = LLM(str(SHIPPED), memory_budget=budget, ssm_state_dtype="bfloat16", **kw)
    try:
        assert f32.cache.state_dtype == torch.float32 and b16.cache.state_dtype == torch.bfloat16
        assert f32.num_slots == 6
        lay = f32.plan.layout
        # the fixed part of a slot shrinks by half its state bytes, so the budget holds more
        assert f32.plan.memory.fixed - b16.plan.memory.fixed == lay.state_bytes // 2 > 0
        assert b16.num_slots == budget // b16.plan.memory.need(256 + 1) > f32.num_slots
        out = b16.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        assert len(out.token_ids) == 8
    finally:
        f32.close()
        b16.close()


def test_generate_flags():
    p = cli.build_parser()
    assert p.parse_args(["hi"]).ssm_state_dtype == "auto"
    assert p.parse_args(["hi", "--ssm-state-dtype", "bfloat16"]).ssm_state_dtype == "bfloat16"
    assert p.parse_args(["hi", "--mamba-ssm-cache-dtype", "float16"]).ssm_state_dtype == "float16"
    with pytest.raises(SystemExit):
        p.parse_args(["hi", "--ssm-state-dtype", "bf16"])
    from replayssm.bench import e2e

    assert e2e.build_parser().parse_args([]).ssm_state_dtype == "auto"
    assert e2e.build_parser().parse_args(["--mamba-ssm-cache-dtype", "bfloat16"]).ssm_state_dtype == "bfloat16"


@needs_shipped
def test_generate_runs_with_16bit_states(capsys):
    assert cli.main(["def add(a, b):", "--max-tokens", "6", "--ssm-state-dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.startswith("def add(a, b):")


@needs_shipped
def test_serve_flags_reach_the_engine():
    from replayssm.server import cli as serve_cli

    args = serve_cli.build_parser().parse_args([str(SHIPPED), "--mamba-ssm-cache-dtype", "bfloat16",
                                                "--device", "cpu", "--max-num-seqs", "2", "--max-seq-len", "64"])
    assert args.ssm_state_dtype == "bfloat16"
    llm = serve_cli.build_engine(str(SHIPPED), args)
    try:
        assert llm.config.ssm_state_dtype == "bfloat16" and llm.cache.state_dtype == torch.bfloat16
        assert "SSM states bfloat16" in serve_cli.startup_summary(llm, "m", str(SHIPPED))
    finally:
        llm.close()


@needs_shipped
def test_jax_backend_refuses_16bit_states(capsys):
    pytest.importorskip("jax")
    from replayssm import cli as top

    assert top.main(["generate", "hi", "--backend", "jax", "--ssm-state-dtype", "bfloat16"]) == 2
    assert "keeps float32 states" in capsys.readouterr().err
