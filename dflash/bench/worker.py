"""The process one benchmark method runs in: `python -m dflash.bench.worker` (dflash.bench.methods.worker).

A module of its own, imported by nothing: run with -m, a module the package has already imported would be
executed a second time (runpy's RuntimeWarning in every worker log)."""

import os
import sys

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from dflash.bench.methods import worker  # noqa: E402  (after the verbosity setting, which transformers reads at import)

if __name__ == "__main__":
    sys.exit(worker())
