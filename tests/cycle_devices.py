"""Devices whose cycle times are fixed (dflash.core.cycle_times.CycleTimes.fixed), shared by the planner's tests."""

from dflash.core.cycle_times import CycleTimes


def cpu(block_size: int = 16) -> CycleTimes:
    """A CPU-like device: a verify of n tokens costs 1 + 0.25 (n - 1) plain steps, a draft forward of the whole block
    0.5 per row."""
    return CycleTimes.fixed(plain=1.0, token=0.25, draft=0.5, block_size=block_size)


# a batch-heavy CPU: a draft forward fills every position of every row, so at 16 rows a block of 16 costs about as
# much as the verify it feeds (16 tokens each), and a short block a quarter of it
HEAVY = CycleTimes.fixed(plain=1.0, token=1 / 63, draft=0.25)
CPU = cpu()
