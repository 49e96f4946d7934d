"""dflash/core/costs.py: the device profile of --verify auto, measured through the engine, cached per shape, checked
when read back, and corrected online from the cycles the engine ran."""

import json
import time

import pytest
torch = pytest.importorskip("torch")

from dflash.backends.torch.backend import torch_engine
from dflash.backends.torch.drafter import DFlashDrafter, load_drafter
from dflash.backends.torch.target import load_target
from dflash.core import costs, progress
from dflash.core.chain_budget import ChainBudget
from dflash.core.cost_model import Costs
from dflash.core.loop import generate


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    return tmp_path / "costs"


@pytest.fixture
def steady(monkeypatch):
    """Timing rules that load on a shared CPU would otherwise trip: every batch shape is measured, and a cached
    profile is read back whatever this run's plain step takes and however far its cycles ran from it (the rules
    themselves have their own tests)."""
    monkeypatch.setattr(costs, "BATCH_SECONDS", float("inf"))
    monkeypatch.setattr(costs, "LIVE_TOLERANCE", float("inf"))
    monkeypatch.setattr(costs, "DRIFT_TOLERANCE", float("inf"))


@pytest.fixture(scope="module")
def engine(tiny_target_dir, random_draft_dir):
    return torch_engine(load_target(tiny_target_dir, torch.float32, "cpu"), load_drafter(random_draft_dir),
                        block_size=8)


def test_measured_once_with_a_notice_then_read_from_the_cache(engine, cache, monkeypatch, capsys, steady):
    first = costs.measured_costs(engine, max_tokens=17, label="tiny")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("dflash: measuring this device's draft and verify costs for tiny")
    assert "first run only" in err[0]
    # one line when it starts, one when done, and between them (on a machine slow enough) progress lines
    assert all(line.startswith("dflash: still measuring, ") for line in err[1:-1])
    assert err[-1].startswith("dflash: measured in ")
    ns = [n for n, _ in first.verify]
    assert ns[0] == 1 and ns == sorted(ns) and first.draft > 0 and costs.insane(first) is None
    assert sorted(first.batch) == list(costs.BATCH_ROWS) and sorted(first.draft_batch) == list(costs.BATCH_ROWS)
    assert [n for n, _ in first.batch[4]] == [1, 4]  # tokens per row up to the block
    assert sorted(first.draft_blocks) == [2, 4, 8] and first.draft_blocks[8] == {1: first.draft}
    assert first.longer is not None and [n for n, _ in first.longer.verify] == [1, 8]
    assert engine.rows == [] and engine.pending is None  # the engine is left empty
    (path,) = cache.glob("*.json")
    assert "torch" in json.loads(path.read_text())["device"]

    calls = []
    monkeypatch.setattr(costs, "measure", lambda *a, **k: calls.append(1))
    again = costs.measured_costs(engine, max_tokens=17)
    assert again == first and not calls and capsys.readouterr().err == ""


def test_batches_are_left_out_where_one_row_of_as_many_tokens_is_already_slow(engine, cache, monkeypatch):
    monkeypatch.setattr(costs, "BATCH_SECONDS", 0.0)
    profile = costs.measured_costs(engine, max_tokens=17, use_cache=False)
    assert profile.batch == {} and profile.draft_batch == {} and costs.insane(profile) is None


def test_a_damaged_cache_file_is_measured_again(tiny_target_dir, cache):
    backend = torch_engine(load_target(tiny_target_dir, torch.float32, "cpu"))
    path = costs.cache_dir() / f"{costs.cost_key(backend)}.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    measured = costs.measured_costs(backend, max_tokens=3)
    assert measured.verify[0][0] == 1 and json.loads(path.read_text())["verify_seconds"]


def test_a_profile_that_is_not_monotone_is_rejected_and_measured_again(engine, cache, capsys):
    good = costs.measured_costs(engine, max_tokens=17)
    path = cache / f"{costs.cost_key(engine)}.json"
    bad = good.to_json()
    (n1, t1), (n2, _) = bad["verify_seconds"][:2]
    bad["verify_seconds"][1] = [n2, t1 / 2]  # two tokens cheaper than one
    path.write_text(json.dumps(bad | {"max_tokens": 17}))
    capsys.readouterr()
    again = costs.measured_costs(engine, max_tokens=17)
    assert "not monotone in tokens" in capsys.readouterr().err
    assert costs.insane(again) is None and costs.insane(Costs.from_json(json.loads(path.read_text()))) is None


def test_a_cached_plain_step_far_from_the_live_one_is_measured_again(engine, cache, capsys):
    """A profile measured while another process held the core: every point 10x what this run takes."""
    good = costs.measured_costs(engine, max_tokens=17)
    path = cache / f"{costs.cost_key(engine)}.json"
    slow = Costs.from_json(good.to_json())
    slow.verify = [(n, 10 * t) for n, t in slow.verify]
    path.write_text(json.dumps(slow.to_json() | {"max_tokens": 17}))
    capsys.readouterr()
    again = costs.measured_costs(engine, max_tokens=17)
    assert "is far from this run's" in capsys.readouterr().err
    assert again.verify[0][1] < slow.verify[0][1] / 2


def test_a_profile_its_cycles_found_far_off_is_measured_again_once(engine, cache, capsys, steady, monkeypatch):
    """Measured under load: the cycles run with it took 0.45x its predictions on average. The next load measures it
    again and says why; the profile measured then is not measured again for drift (a bias the cycles keep finding is
    the corrections' to carry), while a profile off by less is kept."""
    monkeypatch.setattr(costs, "DRIFT_TOLERANCE", 1.5)
    first = costs.measured_costs(engine, max_tokens=17)
    saved = cache / f"{costs.cost_key(engine)}.corrections.json"
    saved.write_text(json.dumps({"all": 1.3, "plain:1x1": 1.2}))
    capsys.readouterr()
    assert costs.measured_costs(engine, max_tokens=17) == first and capsys.readouterr().err == ""
    saved.write_text(json.dumps({"all": 0.45, "plain:1x1": 0.3}))
    again = costs.measured_costs(engine, max_tokens=17)
    assert "the cycles run with it took 0.45x its predictions on average" in capsys.readouterr().err
    assert again.corrections.factors == {}  # (learnt against the old profile)
    saved.write_text(json.dumps({"all": 0.45}))
    kept = costs.measured_costs(engine, max_tokens=17)
    assert capsys.readouterr().err == "" and kept == again


def test_a_ten_times_too_slow_plain_step_is_corrected_within_a_few_dozen_cycles():
    """The cycles' own times (here a fake clock: the device's true costs, 20% noise either way) correct the shape
    they ran, whatever the cycle clock makes of the rest."""
    true = Costs(draft=1.0, verify=[(1, 1.0), (2, 1.1), (16, 2.0)])
    wrong = Costs(draft=1.0, verify=[(1, 10.0), (2, 10.0), (16, 10.0)])
    budget = ChainBudget(16, wrong)
    for i in range(25):
        budget.observe(0, [0], true.cycle_seconds(1, drafted=False) * (1.2 if i % 2 else 0.8))  # plain steps
    assert abs(wrong.cycle_seconds(1, drafted=False) - 1.0) < 0.15
    for i in range(25):
        budget.observe(15, [3], true.cycle_seconds(16) * (1.2 if i % 2 else 0.8))  # whole chains
    assert abs(wrong.cycle_seconds(16) - 3.0) < 0.45 and abs(wrong.cycle_seconds(1, drafted=False) - 1.0) < 0.15


def test_a_profile_off_everywhere_keeps_its_proportions_in_shapes_not_run_yet():
    """Measured under load, every forward 5x: the shapes run so far are corrected, and the others follow them."""
    true = Costs(draft=1.0, verify=[(1, 1.0), (16, 2.0)])
    busy = Costs(draft=5.0, verify=[(1, 5.0), (16, 10.0)])
    for _ in range(10):
        busy.observe(16, 1, True, true.cycle_seconds(16))
    assert abs(busy.cycle_seconds(16) - 3.0) < 1e-6
    assert abs(busy.cycle_seconds(1, drafted=False) - 1.0) < 1e-6  # never run: the average factor


def test_corrections_are_learnt_from_the_engine_and_saved_with_the_profile(engine, cache, monkeypatch, steady):
    monkeypatch.setattr("dflash.core.corrections.SAVE_EVERY", 4)
    profile = costs.measured_costs(engine, max_tokens=17)
    engine.set_verify("auto", None, profile)
    r = generate(engine, list(range(5, 30)), max_new_tokens=48)
    # every cycle is timed against its shape but a pause's probe (budget.TreePlanner.observe) and each shape's first
    flags = r.draft_forwards
    probes = sum(drafted and not before for before, drafted in zip(flags, flags[1:]))
    learnt = profile.corrections
    assert len(flags) == len(r.acceptance_lengths) and learnt.observed == len(flags) - probes - len(learnt.warm)
    saved = json.loads((cache / f"{costs.cost_key(engine)}.corrections.json").read_text())
    assert saved and set(saved) <= set(profile.corrections.factors)
    assert costs.measured_costs(engine, max_tokens=17).corrections.factors == {"all": saved["all"]}  # read back
    engine.set_verify("chain")


def test_drafters_of_different_shapes_get_their_own_profiles(tiny_target_dir, random_draft_dir):
    model = load_target(tiny_target_dir, torch.float32, "cpu")
    two = load_drafter(random_draft_dir)
    spec = two.spec
    deeper = DFlashDrafter(type(spec)(**{**vars(spec), "num_hidden_layers": spec.num_hidden_layers + 1,
                                        "layer_types": None}))
    a, b = torch_engine(model, two, block_size=8), torch_engine(model, deeper, block_size=8)
    assert a.drafter.spec.num_hidden_layers != b.drafter.spec.num_hidden_layers
    assert costs.cost_key(a) != costs.cost_key(b)
    assert costs.cost_key(a) == costs.cost_key(torch_engine(model, load_drafter(random_draft_dir), block_size=8))
    assert costs.cost_key(a) != costs.cost_key(torch_engine(model, two, block_size=16))  # another block: its own
    # a draft vocabulary makes the draft head a fraction of the target's: its own profile too
    small = DFlashDrafter(type(spec)(**{**vars(spec), "draft_vocab_size": spec.vocab_size // 4}))
    assert costs.cost_key(a) != costs.cost_key(torch_engine(model, small, block_size=8))


def test_a_long_measurement_says_what_it_times(engine, cache, monkeypatch, capsys, steady):
    """A profile measured under load takes a minute or two: a line every few seconds names the point being
    timed, so the wait never reads as a hang."""
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.001)
    slow = costs.Probe.verify
    monkeypatch.setattr(costs.Probe, "verify", lambda self, n, rows=1: (time.sleep(0.005), slow(self, n, rows))[1])
    costs.measured_costs(engine, max_tokens=17, use_cache=False, label="tiny")
    err = capsys.readouterr().err.splitlines()
    beats = [line for line in err if line.startswith("dflash: still measuring, ")]
    assert beats and err[-1].startswith("dflash: measured in ")
    assert any(" so far: a verify of 4 tokens after " in line for line in beats), beats[:5]
    assert any(" in each of 4 rows after " in line for line in beats)
    assert progress.Heartbeat.now is None  # the thread is gone with the measurement
