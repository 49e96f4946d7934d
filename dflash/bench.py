"""python -m dflash.bench: `cost-model` (cycle cost vs. autoregressive step) and the end-to-end benchmark."""

from __future__ import annotations

import sys

from . import cli


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "cost-model":
        from .costmodel import main as cost_model

        return cost_model(argv[1:])
    from .benchmark import main as benchmark

    return benchmark(argv[1:] if argv and argv[0] == "run" else argv)


if __name__ == "__main__":
    sys.exit(cli.run(main))
