"""`python -m dflash.bench ablation`: the drafter-recipe ablations of docs/training.md, section 5 (a run trains for
minutes, so only what it checks before training is tested here)."""

from __future__ import annotations

from dflash.bench import ablation
from dflash.bench import main as bench_main


def test_overrides_are_json_values_else_strings():
    assert ablation.parse_value("1e-3") == 1e-3 and ablation.parse_value("[1, 3]") == [1, 3]
    assert ablation.parse_value('"target"') == "target" and ablation.parse_value("target") == "target"


def test_missing_answers_are_one_line_naming_the_command_that_makes_them(tmp_path, capsys):
    from dflash import cli

    assert cli.run(bench_main, ["ablation", "--name", "x", "--data", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "python -m dflash.reference build" in err and "--answers-only" in err
