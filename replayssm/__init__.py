"""replayssm: exact replay-buffer decoding for Mamba-2 and Gated DeltaNet models."""

__version__ = "0.1.0"
