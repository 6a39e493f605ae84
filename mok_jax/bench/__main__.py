"""``python -m mok_jax.bench``: the mok-bench command line (see mok_jax.bench.cli)."""

import sys

from mok_jax.bench.cli import main

sys.exit(main())
