"""python -m dflash.bench: the end-to-end benchmark (`run`, the default), `cost-model` (cycle cost vs. an
autoregressive step) and `gpu-check` (the prepared GPU report, scripts/gpu_check.sh)."""

from __future__ import annotations

import sys

from .. import cli
from . import benchmark, costmodel, gpucheck

COMMANDS = {"run": benchmark.main, "cost-model": costmodel.main, "gpu-check": gpucheck.main}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    return benchmark.main(argv)


if __name__ == "__main__":
    sys.exit(cli.run(main))
