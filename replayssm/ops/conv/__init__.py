"""Short causal depthwise conv: reference ops in ``naive``."""
