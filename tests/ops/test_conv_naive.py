"""Causal depthwise conv with a rollback-able window, against torch conv1d over streams."""

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from replayssm.cache.conv import ConvWindow
from replayssm.ops.conv.naive import (conv_commit, conv_commit_tree, conv_decode, conv_prefill, conv_tree,
                                      conv_verify, conv_window_out)
from replayssm.cache.tree import path_to

f64 = torch.float64


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tiny grouped conv1d calls (the reference); ``tests/conftest.py``)."""


def _ref(stream, weight, bias, act):
    """Outputs of the conv over a whole stream ``[C, T]`` from zeros (HF conv1d layout)."""
    C, W = weight.shape
    y = F.conv1d(stream[None], weight[:, None, :], bias, padding=W - 1, groups=C)[0, :, :stream.shape[1]]
    return F.silu(y) if act == "silu" else y


def _params(rng_t, C, W, with_bias):
    weight = torch.randn(C, W, dtype=f64, generator=rng_t)
    bias = torch.randn(C, dtype=f64, generator=rng_t) if with_bias else None
    return weight, bias


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), W=st.integers(1, 5), T=st.integers(1, 9),
       with_bias=st.booleans(), act=st.sampled_from([None, "silu"]))
def test_prefill_matches_conv1d(seed, W, T, with_bias, act):
    g = torch.Generator().manual_seed(seed)
    Bt, C = 3, 4
    weight, bias = _params(g, C, W, with_bias)
    x = torch.randn(Bt, T, C, dtype=f64, generator=g)
    out, win = conv_prefill(x, weight, bias, None, act)
    assert out.shape == (Bt, T, C) and win.shape == (Bt, C, W - 1)
    for b in range(Bt):
        torch.testing.assert_close(out[b], _ref(x[b].T, weight, bias, act).T, rtol=1e-12, atol=1e-12)
        full = torch.cat([torch.zeros(C, W - 1, dtype=f64), x[b].T], 1)
        assert torch.equal(win[b], full[:, full.shape[1] - (W - 1):])
    # HF weight layout [C, 1, W]
    out2, _ = conv_prefill(x, weight[:, None, :], bias, None, act)
    assert torch.equal(out, out2)
    # continuing from the final window == convolving the concatenation
    x2 = torch.randn(Bt, 4, C, dtype=f64, generator=g)
    out3, win3 = conv_prefill(x2, weight, bias, win, act)
    both, winb = conv_prefill(torch.cat([x, x2], 1), weight, bias, None, act)
    torch.testing.assert_close(out3, both[:, T:], rtol=1e-12, atol=1e-12)
    assert torch.equal(win3, winb)
    # right-padded rows: final window after lengths[b] tokens
    lengths = torch.tensor([T, 1, (T + 1) // 2])
    _, winl = conv_prefill(x, weight, bias, None, act, lengths=lengths)
    for b in range(Bt):
        _, wb = conv_prefill(x[b:b + 1, :int(lengths[b])], weight, bias, None, act)
        assert torch.equal(winl[b], wb[0])


def test_prefill_dtypes():
    x = torch.randn(2, 5, 3, dtype=torch.float32)
    w = torch.randn(3, 4, dtype=torch.float32)
    out, win = conv_prefill(x, w, None, None, "silu")
    assert out.dtype == torch.float32 and win.dtype == torch.float32
    outd, _ = conv_prefill(x.double(), w.double(), None, None, "silu")
    torch.testing.assert_close(out.double(), outd, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), W=st.integers(1, 5), with_bias=st.booleans(),
       act=st.sampled_from([None, "silu"]))
def test_verify_commit_sequence_equals_accepted_stream(seed, W, with_bias, act):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    S, C = 3, 4
    weight, bias = _params(g, C, W, with_bias)
    win = ConvWindow.allocate(S, C, W, dtype=f64, poison=False)
    win.window[0] = float("nan")  # null slot garbage must not leak
    streams = {s: torch.zeros(C, 0, dtype=f64) for s in range(1, S + 1)}
    for step in range(12):
        rows = rng.sample(range(1, S + 1), rng.randint(1, S)) + [0] * rng.randint(0, 1)
        rng.shuffle(rows)
        slot = torch.tensor(rows)
        decode = rng.random() < 0.3
        T = 1 if decode else rng.randint(1, 5)
        x = torch.randn(len(rows), T, C, dtype=f64, generator=g)
        if decode:
            out = conv_decode(win, slot, x[:, 0], weight, bias, act)[:, None]
            acc = torch.ones(len(rows), dtype=torch.long)
        else:
            before = win.window.clone()
            out = conv_verify(win, slot, x, weight, bias, act)
            assert torch.equal(win.window[1:], before[1:])        # verify never writes
            acc = torch.tensor([rng.randint(0, T) for _ in rows])
            conv_commit(win, slot, x, acc)
        for b, s in enumerate(rows):
            if s == 0:
                continue
            full = torch.cat([streams[s], x[b].T], 1)
            ref = _ref(full, weight, bias, act)[:, -T:].T
            torch.testing.assert_close(out[b], ref, rtol=1e-12, atol=1e-12)
            streams[s] = torch.cat([streams[s], x[b, :int(acc[b])].T], 1)
            padded = torch.cat([torch.zeros(C, W - 1, dtype=f64), streams[s]], 1)
            assert torch.equal(win.window[s], padded[:, padded.shape[1] - (W - 1):])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), W=st.integers(1, 5), N=st.integers(1, 8),
       act=st.sampled_from([None, "silu"]))
def test_tree_matches_per_path_recomputation(seed, W, N, act):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    S, C = 3, 2
    weight, bias = _params(g, C, W, True)
    win = ConvWindow.allocate(S, C, W, dtype=f64)
    hist = {s: torch.randn(C, rng.randint(0, 6), dtype=f64, generator=g) for s in range(1, S + 1)}
    for s in range(1, S + 1):
        padded = torch.cat([torch.zeros(C, W - 1, dtype=f64), hist[s]], 1)
        win.window[s] = padded[:, padded.shape[1] - (W - 1):]
    rows = [2, 0, 3, 1]
    slot = torch.tensor(rows)
    parent = torch.tensor([[-1] + [rng.randrange(-1, i) for i in range(1, N)] for _ in rows])
    x = torch.randn(len(rows), N, C, dtype=f64, generator=g)
    before = win.window.clone()
    out = conv_tree(win, slot, x, parent, weight, bias, act)
    assert torch.equal(win.window, before)
    for b, s in enumerate(rows):
        if s == 0:
            continue
        for i in range(N):
            path, length = path_to(parent[b:b + 1], torch.tensor([i]))
            nodes = path[0, :int(length[0])]
            full = torch.cat([hist[s], x[b, nodes].T], 1)
            ref = _ref(full, weight, bias, act)[:, -1]
            torch.testing.assert_close(out[b, i], ref, rtol=1e-12, atol=1e-12)
    # a shared [N] tree gives the same as its expansion
    out_shared = conv_tree(win, slot, x, parent[0], weight, bias, act)
    out_exp = conv_tree(win, slot, x, parent[0].expand(len(rows), N), weight, bias, act)
    assert torch.equal(out_shared, out_exp)
    # a chain tree equals conv_verify
    chain = torch.arange(-1, N - 1).expand(len(rows), N)
    torch.testing.assert_close(conv_tree(win, slot, x, chain, weight, bias, act),
                               conv_verify(win, slot, x, weight, bias, act), rtol=1e-12, atol=1e-12)
    # commit an accepted path prefix
    leaf = torch.tensor([rng.randrange(N) for _ in rows])
    path, depth = path_to(parent, leaf)
    acc = torch.tensor([rng.randint(0, int(d)) for d in depth])
    conv_commit_tree(win, slot, x, path, acc, parent=parent)
    for b, s in enumerate(rows):
        if s == 0:
            continue
        full = torch.cat([torch.zeros(C, W - 1, dtype=f64), hist[s],
                          x[b, path[b, :int(acc[b])]].T], 1)
        assert torch.equal(win.window[s], full[:, full.shape[1] - (W - 1):])


def test_validation_before_writes():
    C, W = 3, 4
    win = ConvWindow.allocate(2, C, W, dtype=f64)
    win.window.normal_()
    snap = win.window.clone()
    w = torch.randn(C, W, dtype=f64)
    x = torch.randn(2, 3, C, dtype=f64)
    slot = torch.tensor([1, 2])
    bad_calls = [
        lambda: conv_verify(win, slot, torch.randn(2, 3, C + 1, dtype=f64), w),
        lambda: conv_verify(win, slot, x, torch.randn(C, W + 1, dtype=f64)),
        lambda: conv_verify(win, slot, x, w, torch.randn(C + 1, dtype=f64)),
        lambda: conv_verify(win, slot, x, w, None, "gelu"),
        lambda: conv_verify(win, torch.tensor([1, 3]), x, w),
        lambda: conv_verify(win, torch.tensor([1]), x, w),
        lambda: conv_verify(win, torch.tensor([1.0, 2.0]), x, w),
        lambda: conv_verify(win, slot, torch.randn(2, 0, C, dtype=f64), w),
        lambda: conv_commit(win, slot, x, torch.tensor([4, 0])),
        lambda: conv_commit(win, slot, x, torch.tensor([-1, 0])),
        lambda: conv_commit(win, slot, x, torch.tensor([1])),
        lambda: conv_commit(win, slot, x, torch.tensor([1.0, 1.0])),
        lambda: conv_commit(win, torch.tensor([1, 5]), x, torch.tensor([1, 1])),
        lambda: conv_tree(win, slot, x, torch.tensor([-1, 1, 0]), w),       # not topological
        lambda: conv_tree(win, slot, x, torch.tensor([-1, 0]), w),          # wrong N
        lambda: conv_commit_tree(win, slot, x, torch.tensor([[0, 1, 2], [0, 3, 0]]),
                                 torch.tensor([2, 2])),                      # id out of range
        lambda: conv_commit_tree(win, slot, x, torch.tensor([[0, 1, 2], [0, 2, 0]]),
                                 torch.tensor([2, 4])),                      # accepted > N
        lambda: conv_commit_tree(win, slot, x, torch.tensor([[0, 2, 2], [0, 1, 0]]),
                                 torch.tensor([2, 1]), parent=torch.tensor([-1, 0, 1])),  # not a chain
        lambda: conv_decode(win, slot, x, w),
        lambda: conv_prefill(torch.randn(2, 3, C, dtype=f64), w, None,
                             torch.zeros(2, C, W, dtype=f64)),
        lambda: conv_prefill(torch.randn(3, C), w),
        lambda: win.write(slot, torch.zeros(2, C, W, dtype=f64)),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
        assert torch.equal(win.window, snap)
    with pytest.raises(ValueError):
        ConvWindow.allocate(2, C, 0)


def test_window_helpers_and_width_one():
    win = ConvWindow.allocate(3, 2, 3, dtype=f64, poison=True)
    assert win.window.shape == (4, 2, 2) and torch.isnan(win.window).all()
    assert (win.channels, win.width, win.num_slots) == (2, 3, 3)
    win.reset(torch.tensor([1, 2]))
    assert not win.window[1:3].any() and torch.isnan(win.window[3]).all()
    win.write(torch.tensor([3]), torch.ones(1, 2, 2, dtype=torch.float32))
    assert (win.window[3] == 1).all()
    w1 = ConvWindow.allocate(2, 3, 1, dtype=f64)
    w = torch.randn(3, 1, dtype=f64)
    x = torch.randn(2, 4, 3, dtype=f64)
    out = conv_verify(w1, torch.tensor([1, 2]), x, w)
    torch.testing.assert_close(out, x * w[:, 0])
    conv_commit(w1, torch.tensor([1, 2]), x, torch.tensor([2, 4]))
    assert w1.window.shape == (3, 3, 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W", [1, 2, 4])
def test_window_out_is_the_prefills_last_output_bit_for_bit(dtype, W):
    """``conv_window_out`` (prefix-store rebuilds) equals ``conv_prefill(pre)[0][:, -1]``
    exactly, masked inputs reading as zeros, with and without bias / activation."""
    g = torch.Generator().manual_seed(W)
    R, C = 37, 13
    pre = torch.randn(R, W, C, generator=g).to(dtype)
    weight = torch.randn(C, W, generator=g).to(dtype)
    bias = torch.randn(C, generator=g).to(dtype)
    valid = torch.rand(R, W, generator=g) > 0.3
    masked = torch.where(valid[..., None], pre, torch.zeros((), dtype=dtype))
    for b, act in ((bias, "silu"), (None, None)):
        want = conv_prefill(masked, weight, b, None, act)[0][:, -1]
        got = conv_window_out(pre, weight, b, act, valid)
        assert got.dtype == dtype and torch.equal(got, want)
        assert torch.equal(conv_window_out(masked, weight, b, act), want)


def test_window_out_rejects_bad_shapes():
    pre = torch.zeros(3, 4, 5)
    with pytest.raises(ValueError, match="pre must be"):
        conv_window_out(pre[0], torch.zeros(5, 4))
    with pytest.raises(ValueError, match="width 3"):
        conv_window_out(pre, torch.zeros(5, 3))
    with pytest.raises(ValueError, match="valid must be"):
        conv_window_out(pre, torch.zeros(5, 4), valid=torch.ones(3, 3, dtype=torch.bool))
