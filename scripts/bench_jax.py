"""JAX decode loop vs the PyTorch engine (CUDA graphs): see replayssm/jax/bench.py.

    python scripts/bench_jax.py --out $OUT/bench_jax [--presets 2.7b,small] [--batch-sizes 1,16,64]
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from replayssm.jax.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
