"""Repeated runs of one prompt become one record: timings are the median run's, cycles are pooled."""

from dflash.bench.workers import merge_runs


def run(seconds, tokens=(1, 2, 3), cycles=(2, 1)):
    return {"tokens": list(tokens), "seconds": seconds, "prefill_seconds": seconds / 10,
            "decode_seconds": seconds * 0.9, "decode_tokens": 2, "acceptance_lengths": list(cycles),
            "verified": [15] * len(cycles), "cycles_without_draft": 1}


def test_a_disturbed_run_does_not_move_the_prompts_seconds():
    merged = merge_runs([run(1.0), run(9.0), run(1.2)])
    assert merged["seconds"] == 1.2 and merged["decode_seconds"] == 1.2 * 0.9 and merged["prefill_seconds"] == 0.12
    assert merged["run_seconds"] == [1.0, 9.0, 1.2] and not merged["runs_differ"]
    assert merged["acceptance_lengths"] == [2, 1] * 3 and merged["verified"] == [15] * 6
    assert merged["cycles_without_draft"] == 3 and merged["tokens"] == [1, 2, 3]


def test_one_run_is_its_own_record_and_a_differing_or_failed_run_shows():
    single = run(1.0)
    assert merge_runs([single]) is single
    assert merge_runs([run(1.0), run(1.0, tokens=(1, 2, 4))])["runs_differ"]
    assert merge_runs([run(1.0), {"error": "boom"}]) == {"error": "boom"}
    baseline = dict(run(1.0), acceptance_lengths=None, verified=None, cycles_without_draft=None)
    merged = merge_runs([baseline, dict(baseline, seconds=3.0)])
    assert merged["seconds"] == 2.0 and merged["acceptance_lengths"] is None
