"""The fused decode-conv kernel against the reference window ops (output and window)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

from replayssm.cache.conv import ConvWindow  # noqa: E402
from replayssm.ops.conv.naive import conv_commit, conv_decode, conv_verify  # noqa: E402
from replayssm.kernels import conv as KC  # noqa: E402

DEVICE = kernel_device()


def _setup(g, P, C, W, dtype, bias):
    """A reference window of ``P - 1`` slots filled at random, a copy for the kernel, taps
    and bias."""
    win_ref = ConvWindow.allocate(P - 1, C, W, dtype=dtype, device=DEVICE)
    win_ref.window.copy_(torch.randn(win_ref.window.shape, generator=g).to(dtype))
    win = ConvWindow(win_ref.window.clone())
    w = torch.randn(C, W, generator=g).to(DEVICE)
    b = torch.randn(C, generator=g).to(DEVICE) if bias else None
    return win_ref, win, w, b


@pytest.mark.parametrize("C,W,bias,act,dtype", [
    (13, 4, True, "silu", torch.float32), (7, 3, False, None, torch.float32),
    (300, 4, True, "silu", torch.bfloat16), (5, 2, True, "silu", torch.float32), (6, 1, True, "silu", torch.float32)])
def test_conv_decode_kernel_matches_reference(C, W, bias, act, dtype):
    g = torch.Generator().manual_seed(C * W)
    P, Bt = 6, 4
    win_ref, win, w, b = _setup(g, P, C, W, dtype, bias)
    slot = torch.tensor([3, 1, 5, 2], device=DEVICE)
    for step in range(3):  # the window advances: later steps read what earlier ones wrote
        full = torch.randn(Bt, C + 5, generator=g).to(dtype).to(DEVICE)
        x = full[:, 2:2 + C]  # strided rows, as the layer's slice of the in_proj output
        y_ref = conv_decode(win_ref, slot, x, w, b, act)
        y = KC.conv_decode(win, slot, x, w, b, act)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(y.float(), y_ref.float(), **tol, msg=lambda m: f"out, step {step}: {m}")
        torch.testing.assert_close(win.window, win_ref.window, atol=0, rtol=0,
                                   msg=lambda m: f"window, step {step}: {m}")


def test_conv_decode_kernel_rejects_bad_shapes():
    win = ConvWindow.allocate(3, 8, 4, device=DEVICE)
    with pytest.raises(ValueError, match="channels"):
        KC.conv_decode(win, torch.tensor([1], device=DEVICE), torch.zeros(1, 9, device=DEVICE),
                       torch.zeros(9, 4, device=DEVICE))
    with pytest.raises(ValueError, match="taps"):
        KC.conv_decode(win, torch.tensor([1], device=DEVICE), torch.zeros(1, 8, device=DEVICE),
                       torch.zeros(8, 3, device=DEVICE))


@pytest.mark.parametrize("C,W,T,bias,act,dtype", [
    (13, 4, 5, True, "silu", torch.float32), (7, 3, 1, False, None, torch.float32),
    (300, 4, 6, True, "silu", torch.bfloat16), (5, 2, 3, True, "silu", torch.float32),
    (6, 1, 2, True, "silu", torch.float32), (9, 5, 2, True, None, torch.float32)])
def test_conv_verify_and_commit_kernels_match_reference(C, W, T, bias, act, dtype):
    """Verify (window untouched) then commit of a random accepted count per row — counts 0,
    T and in between, T shorter than the window — against the reference ops, over several
    steps so later steps read windows the kernels wrote.  Padding rows on the null slot."""

    g = torch.Generator().manual_seed(C * W + T)
    P, Bt = 7, 5
    win_ref, win, w, b = _setup(g, P, C, W, dtype, bias)
    slot = torch.tensor([3, 1, 6, 2, 0], device=DEVICE)  # the last row pads on the null slot
    real = slot != 0
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for step in range(4):
        full = torch.randn(Bt, T, C + 7, generator=g).to(dtype).to(DEVICE)
        x = full[:, :, 3:3 + C]  # strided rows and tokens, as the layer's slice of in_proj
        before = win.window.clone()
        y_ref = conv_verify(win_ref, slot, x, w, b, act)
        y = KC.conv_verify(win, slot, x, w, b, act)
        torch.testing.assert_close(y[real].float(), y_ref[real].float(), **tol,
                                   msg=lambda m: f"out, step {step}: {m}")
        assert torch.equal(win.window, before), "conv_verify changed the window"
        acc = torch.randint(0, T + 1, (Bt,), generator=g)
        acc[step % Bt] = T
        acc[(step + 1) % Bt] = 0
        acc = acc.to(DEVICE)
        conv_commit(win_ref, slot, x, acc)
        KC.conv_commit(win, slot, x, acc)
        torch.testing.assert_close(win.window[1:], win_ref.window[1:], atol=0, rtol=0,
                                   msg=lambda m: f"window, step {step}: {m}")
