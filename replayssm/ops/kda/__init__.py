"""KDA (Kimi Delta Attention, Kimi-Linear): the gated delta rule with a per-key-channel decay.

:mod:`replayssm.ops.kda.naive` holds the float64-capable reference ops of every form."""
