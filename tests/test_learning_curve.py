"""`python -m dflash.bench learning-curve`: evaluation rows of a training log against the answer tokens trained on, and the
log-linear projection of the data a goal needs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dflash.bench import learningcurve
from dflash.bench import main as bench_main


@pytest.fixture(scope="module")
def curve():
    return learningcurve


def write_log(run: Path, points) -> Path:
    run.mkdir()
    rows = [{"step": 1, "loss": 3.0, "answer_tokens": 10}]
    rows += [{"step": s, "tau": t, "cycles": 9, "per_position": [p, 0.1, 0.0], "answer_tokens": n}
             for s, n, t, p in points]
    rows.append(dict(rows[-1], tau=9.9))  # a resumed run repeats its last evaluation: the newest row wins
    (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_evaluations_projection_and_table(curve, tmp_path):
    # tau = 1 + 0.1 ln(n / 1000): reaches 2.0 at n = 1000 e^10
    points = [(s, n, 1 + 0.1 * math.log(n / 1000), 0.2) for s, n in ((10, 1000), (20, 4000), (30, 16000))]
    rows = curve.evaluations(write_log(tmp_path / "run", points))
    assert [r["step"] for r in rows] == [10, 20, 30] and rows[-1]["tau"] == 9.9
    rows[-1]["tau"] = points[-1][2]
    assert curve.projection(rows, lambda r: r["tau"], 2.0) == pytest.approx(1000 * math.exp(10), rel=1e-6)
    assert curve.projection(rows, lambda r: r["per_position"][0], 0.5) is None  # flat: no projection
    text = curve.table({"ce": rows})
    assert "| ce | 30 | 16,000 |" in text and "0.200 / 0.100 / 0.000" in text


def test_main_writes_the_plot(curve, tmp_path, capsys):
    run = write_log(tmp_path / "run", [(10, 1000, 1.1, 0.1), (20, 2000, 1.2, 0.15)])
    assert bench_main(["learning-curve", "--run", f"kl={run}", "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 0
    assert "kl: tau 2.0 projected at" in capsys.readouterr().out


def test_a_continued_run_counts_on_from_the_first(curve, tmp_path):
    first = write_log(tmp_path / "first", [(10, 1000, 1.1, 0.1), (20, 2000, 1.2, 0.15)])
    later = write_log(tmp_path / "later", [(5, 500, 1.3, 0.2), (10, 1000, 1.4, 0.25)])
    rows = curve.continued([first, later])
    assert [r["answer_tokens"] for r in rows] == [1000, 2000, 2500, 3000]
    assert [r["step"] for r in rows] == [10, 20, 25, 30]
    assert [r["tau"] for r in rows] == [1.1, 9.9, 1.3, 9.9]  # (each log's repeated last row wins, as alone)
