"""Devices whose cycle times are fixed, not learnt (FixedTimes), shared by the planner's and the engines' tests."""

import numpy as np

from dflash.core.cycle_times import PRIOR, CycleTimes


class FixedTimes(CycleTimes):
    """A plain step of one row costs `plain`, each further verify token `token`, a draft forward `draft` per row at
    `block_size` positions (fewer: proportionally less); cycles that run teach it nothing."""

    def __init__(self, plain: float, token: float, draft: float, block_size: int = 16):
        super().__init__(block_size)
        self.terms = np.array([plain - token, 0.0, token, 0.0, draft / block_size])
        self.spread = np.zeros((len(PRIOR), len(PRIOR)))

    def observe(self, tokens: int, rows: int, drafted: bool, seconds: float, block: int | None = None,
                draft_rows: int | None = None) -> None:
        pass


def cpu(block_size: int = 16) -> CycleTimes:
    """A CPU-like device: a verify of n tokens costs 1 + 0.25 (n - 1) plain steps, a draft forward of the whole block
    0.5 per row."""
    return FixedTimes(plain=1.0, token=0.25, draft=0.5, block_size=block_size)


# a batch-heavy CPU: a draft forward fills every position of every row, so at 16 rows a block of 16 costs about as
# much as the verify it feeds (16 tokens each), and a short block a quarter of it
HEAVY = FixedTimes(plain=1.0, token=1 / 63, draft=0.25)
CPU = cpu()
