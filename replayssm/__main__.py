"""``python -m replayssm`` runs the command-line interface (see :mod:`replayssm.cli`)."""

import sys

from .cli import main

sys.exit(main())
