"""python -m dflash.reference build [--out DIR] [--fast] [--install]: rebuild the bundled reference pair."""

from __future__ import annotations

import sys

from dflash import cli


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in ("build",):
        print("usage: python -m dflash.reference build [--out DIR] [--fast] [--install]", file=sys.stderr)
        return 2
    from .build import main as build_main

    return build_main(argv[1:])


if __name__ == "__main__":
    sys.exit(cli.run(main))
