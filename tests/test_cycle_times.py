"""dflash/core/cycle_times.py: a cycle's seconds learnt from the cycles themselves, from nothing, following the machine."""

import random

import numpy as np
import pytest

from dflash.core.cycle_times import CycleTimes, features
from cycle_devices import FixedTimes


def cpu(tokens, rows, drafted, block=16):
    """A 2-core CPU: every verified token and every drafted position costs."""
    return 0.003 + 0.0003 * rows + 0.0004 * rows * tokens + (0.001 + 0.00008 * rows * block if drafted else 0.0)


def gpu(tokens, rows, drafted, block=16):
    """A GPU below its knee: a forward costs its launch, whatever it verifies."""
    return 0.007 + 0.00001 * rows * tokens + (0.002 + 0.00002 * rows * block if drafted else 0.0)


def mean(times, tokens, rows=1, drafted=True, block=None):
    return times.expected_seconds(tokens, rows, drafted, block)


def run(times, device, cycles, rng, slow=1.0, widths=(1, 4, 8, 16, 24)):
    for _ in range(cycles):
        drafted = rng.random() < 0.8
        tokens = rng.choice(widths) if drafted else 1
        times.observe(tokens, 1, drafted, slow * device(tokens, 1, drafted) * (1 + 0.05 * rng.random()))


@pytest.mark.parametrize("device", [cpu, gpu])
def test_cycle_times_are_learnt_from_nothing_within_a_few_dozen_cycles(device):
    times, rng = CycleTimes(16), random.Random(0)
    run(times, device, 40, rng)
    for tokens, drafted in ((1, False), (4, True), (16, True), (24, True)):
        assert mean(times, tokens, drafted=drafted) == pytest.approx(device(tokens, 1, drafted), rel=0.1)


def test_the_model_follows_a_busy_neighbour_who_comes_and_goes():
    times, rng = CycleTimes(16), random.Random(1)
    run(times, cpu, 100, rng)
    run(times, cpu, 15, rng, slow=2.0)  # both cores busy: every forward twice as long
    assert mean(times, 16) == pytest.approx(2 * cpu(16, 1, True), rel=0.15)
    run(times, cpu, 15, rng)
    assert mean(times, 16) == pytest.approx(cpu(16, 1, True), rel=0.15)


def test_a_machine_time_slicing_between_processes_reads_as_noisy_not_as_changed():
    """Both cores busy with other work: each cycle is its compute, 1.5x, plus 0-4 preemptions of 8 ms (a plain step
    takes 5.5-21.5 ms). The model learns how noisy the cycles are and prices each shape near its mean time; with a
    fixed 10% noise, every cycle looked like a machine that changed, and its estimates ran to seconds a step."""
    times, rng = CycleTimes(16), random.Random(0)

    def sliced(tokens, drafted):
        work = 1.5 * cpu(tokens, 1, drafted)
        return work + 0.008 * sum(rng.random() < 0.5 for _ in range(int(work / 0.004) + 1))

    for _ in range(400):
        drafted = rng.random() < 0.8
        tokens = rng.choice((1, 4, 8, 16, 24, 64)) if drafted else 1
        times.observe(tokens, 1, drafted, sliced(tokens, drafted))
    for tokens in (1, 16, 160):
        true = sum(sliced(tokens, tokens > 1) for _ in range(2000)) / 2000
        assert mean(times, tokens, drafted=tokens > 1) == pytest.approx(true, rel=0.15)
        assert times.cycle_seconds(tokens, 1, tokens > 1) > 0.85 * true  # (wide trees not priced cheap)


def test_one_stalled_cycle_barely_moves_the_model():
    times, rng = CycleTimes(16), random.Random(2)
    run(times, cpu, 100, rng)
    before = mean(times, 16)
    times.observe(16, 1, True, 100 * cpu(16, 1, True))  # a page fault, a collection, a graph compiled
    assert mean(times, 16) == pytest.approx(before, rel=0.1)


def test_one_cycle_timed_at_nothing_barely_moves_the_model():
    """A cycle whose work another cycle's wall time holds (a step run ahead, mis-attributed) reads as ~0 seconds:
    the plain step and the draft forward keep their costs."""
    times, rng = CycleTimes(16), random.Random(3)
    run(times, cpu, 100, rng)
    plain, chain = mean(times, 1, drafted=False), mean(times, 16)
    times.observe(1, 1, False, 1e-4)
    assert mean(times, 1, drafted=False) == pytest.approx(plain, rel=0.1)
    assert mean(times, 16) == pytest.approx(chain, rel=0.1)


def test_a_shape_never_run_is_priced_optimistically_until_it_is_run():
    """Chains of 16 tokens alone cannot tell a GPU's flat verify from a CPU's steep one: a 128-token tree is priced
    below its estimate, so a plan tries it; once it ran, its price is its measured time."""
    times, rng = CycleTimes(16), random.Random(3)
    run(times, gpu, 60, rng, widths=(16,))
    wide = features(128, 1, True, None, None, 16)
    assert times.cycle_seconds(128) < 0.9 * mean(times, 128) and times.deviation(wide) > 0
    run(times, gpu, 10, rng, widths=(128,))
    assert times.cycle_seconds(128) == pytest.approx(gpu(128, 1, True), rel=0.15)


def test_a_shorter_draft_and_fewer_drafted_rows_cost_less_where_positions_cost():
    times, rng = CycleTimes(16), random.Random(4)
    for _ in range(200):
        rows, block = rng.choice([1, 4, 8]), rng.choice([4, 8, 16])
        times.observe(4, rows, True, cpu(4, rows, True, block), block=block)
    assert times.cycle_seconds(4, 8, True, 4) < times.cycle_seconds(4, 8, True, 16)
    assert times.cycle_seconds(4, 8, True, 16, draft_rows=2) < times.cycle_seconds(4, 8, True, 16)


def test_a_fixed_device_is_what_it_says_and_learns_nothing():
    times = FixedTimes(plain=1.0, token=0.25, draft=0.5)
    assert times.cycle_seconds(1, drafted=False) == 1.0 and times.cycle_seconds(16) == pytest.approx(4.75 + 0.5)
    assert times.cycle_seconds(1, 2, True, 8) == pytest.approx(1.25 + 0.5)  # two rows, half the block each
    times.observe(16, 1, True, 100.0)
    assert np.isclose(times.cycle_seconds(16), 5.25)


@pytest.mark.parametrize("seed", range(10))
def test_one_row_drafting_the_whole_block_on_a_time_sliced_cpu_is_priced_near_its_mean(seed):
    """The bundled pair's cycles under two busy loops: one row, the whole block drafted (so the cycle's own terms and
    the draft forward's are timed only together), each cycle 0.5x-1.5x twice its compute plus preemptions, the fourth
    cycle preempted for three times its length. A Kalman filter whose drift was sized by each term's estimate let the
    largest term take every miss until it held the whole cycle (seed 2: a plain step priced at 2.9x its mean time, a
    128-token verify at 0.26x)."""
    times, rng = CycleTimes(16), random.Random(seed)

    def sliced(tokens, drafted):
        work = 2 * cpu(tokens, 1, drafted)
        return work * (0.5 + rng.random()) + 0.006 * sum(rng.random() < 0.3 for _ in range(int(work / 0.004) + 1))

    for i in range(300):
        drafted = rng.random() < 0.85
        tokens = rng.randrange(8, 41) if drafted else 1
        times.observe(tokens, 1, drafted, sliced(tokens, drafted) * (4 if i == 3 else 1))
    for tokens in (1, 16, 128):
        true = sum(sliced(tokens, tokens > 1) for _ in range(2000)) / 2000
        assert 0.7 < mean(times, tokens, drafted=tokens > 1) / true < 1.4
