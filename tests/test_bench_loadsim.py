"""The batch simulation of --verify auto at Qwen3-8B shape on a roofline H200, run through dflash.core.budget's own
planner: wide trees at low load, narrower as the batch reaches the compute knee, never clearly behind the plain step
or the fixed chain; plain steps on a device where every token costs a step."""

import pytest

from dflash.bench import loadsim


@pytest.fixture(scope="module")
def sweep():
    # (400 cycles, the second half reported: auto starts from nothing and learns the device from its own cycles)
    return loadsim.simulate(cycles=400)


def test_auto_shrinks_its_trees_as_load_grows(sweep):
    assert [r["concurrency"] for r in sweep] == [1, 2, 4, 8, 16, 32]
    nodes = [r["nodes"] for r in sweep]
    assert nodes == sorted(nodes, reverse=True) and nodes[0] > 15 > nodes[-1]  # wider than the chain at 1 only
    assert all(r["drafted"] > 0.9 for r in sweep)  # drafting pays at every load ...
    assert all(r["speedup"] >= 0.97 * r["chain_speedup"] for r in sweep)  # ... at least as the chain does
    assert sweep[0]["speedup"] > 1.2 * sweep[0]["chain_speedup"]  # and well past it where verify is flat
    speedups = [r["speedup"] for r in sweep]
    assert speedups == sorted(speedups, reverse=True)  # ... less as the batch nears the compute knee
    assert "| 32 | 0 |" in loadsim.markdown(sweep)


def test_the_simulation_is_deterministic():
    assert loadsim.simulate([4], cycles=40) == loadsim.simulate([4], cycles=40)
    assert loadsim.simulate([4], cycles=40, seed=1) != loadsim.simulate([4], cycles=40)  # (--seed: other draws)


def test_rows_the_drafter_rarely_gets_right_cost_auto_less_than_the_chain():
    # (400 cycles: auto starts from a CPU's prior and learns the device from its first cycles; a GPU's draft forward,
    # flat in positions, is learnt by trying shorter ones)
    mixed = loadsim.simulate([8], hard=0.5, cycles=400)[0]
    assert mixed["hard_rows"] == 4
    assert mixed["speedup"] > 1.05 * mixed["chain_speedup"]


def test_a_device_past_its_knee_takes_plain_steps():
    """Every token costs the same (a slow device): drafting never pays, and auto says so: beyond its probes it
    runs plain steps, at the plain step's speed."""
    slow = loadsim.Device("compute-bound", bandwidth=1e15, compute=1e12, launch=0.0)
    rows = loadsim.simulate([1, 32], device=slow, cycles=400)
    assert all(r["drafted"] < 0.1 and r["speedup"] > 0.9 and r["chain_speedup"] < 0.5 for r in rows)


def test_flags_are_checked():
    with pytest.raises(SystemExit):
        loadsim.main(["--hard", "2"])
