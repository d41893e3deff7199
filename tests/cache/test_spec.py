"""CacheSpec: one validated description of a model cache."""

import dataclasses

import pytest

from replayssm.cache.spec import CacheSpec


def test_of_replaces_fields_and_names_unknown_ones():
    base = CacheSpec(mode="kv", max_seq_len=64, block_size=4)
    assert CacheSpec.of() == CacheSpec()
    assert CacheSpec.of(base, max_new=3) == dataclasses.replace(base, max_new=3)
    assert CacheSpec.of(base) is base
    with pytest.raises(ValueError, match="kv_block_size"):
        CacheSpec.of(base, kv_block_size=4)
    with pytest.raises(ValueError, match="must be a CacheSpec"):
        CacheSpec.of({"mode": "kv"})


@pytest.mark.parametrize("field,value", [("mode", "paged"), ("buffer_size", 0), ("max_new", True),
                                         ("max_seq_len", 1.5), ("block_size", 0), ("kv_num_blocks", 0),
                                         ("attn_num_blocks", -1), ("prefix_blocks", -1),
                                         ("prefix_checkpoints", "2")])
def test_invalid_fields_raise(field, value):
    with pytest.raises(ValueError, match="mode" if field == "mode" else field):
        CacheSpec(**{field: value})


def test_derived_specs():
    s = CacheSpec(mode="auto", max_seq_len=33, block_size=4, kv_num_blocks=9, attn_num_blocks=5,
                  prefix_blocks=0, prefix_checkpoints=0)
    assert s.initial_form == "kv" and s.paged and s.max_blocks == 9
    assert CacheSpec(mode="replay").initial_form == "replay" and not CacheSpec(mode="replay").paged
    bare = dataclasses.replace(s, kv_num_blocks=None, attn_num_blocks=None, prefix_blocks=None,
                               prefix_checkpoints=None)
    assert s.sizing() == bare
    assert s.for_draft() == dataclasses.replace(bare, mode="replay")
    assert CacheSpec(mode="recurrent").for_draft().mode == "recurrent"
