"""The batch simulation of --verify auto at Qwen3-8B shape on a roofline H200: wide trees at low load, narrower as
the batch reaches the compute knee, never behind the plain step or the fixed chain."""

from dflash.bench import loadsim


def test_auto_shrinks_its_trees_as_load_grows():
    rows = loadsim.simulate()
    assert [r["concurrency"] for r in rows] == [1, 2, 4, 8, 16, 32]
    nodes = [r["nodes"] for r in rows]
    assert nodes == sorted(nodes, reverse=True) and nodes[0] > 15 > nodes[-1]  # wider than the chain at 1 only
    assert all(r["draft"] and r["speedup"] >= r["chain_speedup"] - 1e-9 for r in rows)  # drafting pays at every load
    speedups = [r["speedup"] for r in rows]
    assert speedups == sorted(speedups, reverse=True)  # ... less as the batch nears the compute knee
    assert loadsim.simulate() == rows  # deterministic
    assert "| 32 |" in loadsim.markdown(rows)


def test_a_device_past_its_knee_takes_plain_steps():
    """Every token costs the same (a slow device): drafting never pays, and auto says so."""
    slow = loadsim.Device("compute-bound", bandwidth=1e15, compute=1e12, launch=0.0)
    rows = loadsim.simulate([1, 32], device=slow)
    assert all(not r["draft"] and r["speedup"] == 1.0 for r in rows)
