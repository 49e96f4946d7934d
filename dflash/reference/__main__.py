"""python -m dflash.reference build [--out DIR] [--fast] [--install]: rebuild the bundled pair."""

from __future__ import annotations

import sys

from dflash import cli
from dflash.core.extras.deps import require


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in ("build", "build-ar-draft"):
        print("usage: python -m dflash.reference build [--out DIR] [--fast] [--install]\n"
              "       python -m dflash.reference build-ar-draft [--build-dir DIR] [--out DIR] [--install]",
              file=sys.stderr)
        return 2
    if not {"-h", "--help"} & set(argv):
        require("torch", f"python -m dflash.reference {argv[0]}")  # both train with the PyTorch trainer
    if argv[0] == "build-ar-draft":
        from .ar_draft import main as ar_main

        return ar_main(argv[1:])
    from .build import main as build_main

    return build_main(argv[1:])


if __name__ == "__main__":
    sys.exit(cli.run(main))
