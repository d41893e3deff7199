"""``replayssm quantize MODEL_DIR OUT_DIR [--fp8-block 128 | --per-tensor]``: write an FP8
copy of a float Hugging Face checkpoint (:func:`replayssm.models.quantize.quantize_checkpoint`)."""

from __future__ import annotations

import argparse
import sys


def _block(v: str) -> tuple[int, int]:
    try:
        parts = [int(x) for x in v.replace("x", ",").split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fp8-block takes N or ROWS,COLS (positive ints), got {v!r}") from None
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or min(parts) <= 0:
        raise argparse.ArgumentTypeError(f"--fp8-block takes N or ROWS,COLS (positive ints), got {v!r}")
    return parts[0], parts[1]


def main(argv: list[str] | None = None) -> int:
    from .quant import DEFAULT_SKIP
    from .quantize import quantize_checkpoint

    p = argparse.ArgumentParser(prog="replayssm quantize",
                                description="Write an FP8 (e4m3) copy of a float Hugging Face checkpoint: "
                                            "block-scaled (weight_scale_inv) or per-tensor (weight_scale).")
    p.add_argument("model_dir", help="float (bf16/fp16/fp32) Hugging Face model directory")
    p.add_argument("out_dir", help="where the FP8 checkpoint is written")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--fp8-block", type=_block, default=(128, 128), metavar="N[,M]",
                   help="block-scaled e4m3 weights, one inverse scale per N×M block (default 128)")
    g.add_argument("--per-tensor", action="store_true", help="one scale per weight tensor instead of blocks")
    p.add_argument("--skip", nargs="*", default=list(DEFAULT_SKIP), metavar="NAME",
                   help=f"layer names (or dotted suffixes) left unquantized (default: {' '.join(DEFAULT_SKIP)})")
    a = p.parse_args(argv)
    try:
        qc = quantize_checkpoint(a.model_dir, a.out_dir, None if a.per_tensor else a.fp8_block, tuple(a.skip))
    except (ValueError, FileNotFoundError) as e:
        print(f"replayssm quantize: error: {e}", file=sys.stderr)
        return 2
    scheme = "per-tensor" if a.per_tensor else f"block {qc['weight_block_size']}"
    print(f"wrote {a.out_dir}: FP8 e4m3, {scheme}, {len(qc['ignored_layers'])} layer(s) left unquantized")
    return 0
