"""Figures written to files: matplotlib (optional, the `plot` extra) on its Agg backend, so a machine without a
display writes them too."""

from __future__ import annotations

import sys

from .deps import install_hint, installed, require


def pyplot(needed_by: str):
    """matplotlib.pyplot drawing to files; one line naming `needed_by` and what to install when it is missing."""
    require("matplotlib", needed_by)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def can_plot(command: str) -> bool:
    """Whether matplotlib is installed; if not, one line on stderr says `command` writes its results without plots."""
    if installed("matplotlib"):
        return True
    print(f"{command}: matplotlib is not installed, so no plots ({install_hint('matplotlib')})", file=sys.stderr,
          flush=True)
    return False


def save(fig, path, dpi: int = 120) -> None:
    """Lay the figure out, write it and close it (pyplot keeps every open figure alive)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt

    plt.close(fig)
