"""Model layers: Mamba-2 mixer, Gated DeltaNet, attention, MLP / MoE, norms, RoPE."""

from .attention import Attention
from .context import StepContext
from .gdn import GatedDeltaNet
from .mamba2 import Mamba2Mixer
from .mlp import GatedMLP, PlainMLP, SigmoidMoE, SoftmaxMoE
from .norms import GatedRMSNorm, RMSNorm
from .rotary import Rotary

__all__ = ["Attention", "StepContext", "GatedDeltaNet", "Mamba2Mixer", "GatedMLP", "PlainMLP",
           "SigmoidMoE", "SoftmaxMoE", "GatedRMSNorm", "RMSNorm", "Rotary"]
