"""The experiments kept as `python -m dflash.bench` subcommands: `ablation` (docs/training.md, section 5; a run
trains for minutes, so only what it checks before training is tested here) and `acceptance` (docs/sampling.md)."""

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


def test_acceptance_per_rule_on_the_bundled_pair(tmp_path, capsys):
    """`python -m dflash.bench acceptance` (docs/sampling.md's table), at a toy size: one prompt, one rule."""
    import json

    from dflash.bench import acceptance

    assert acceptance.conditional_acceptance([0, 2, 3], [15, 15, 15], 3) == [2 / 3, 1.0, 0.5]
    out = tmp_path / "rows.json"
    assert bench_main(["acceptance", "--num-prompts", "1", "--max-new-tokens", "8", "--temperatures", "0.7",
                       "--rules", "rejection", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["accept"] == "rejection" and row["temperature"] == 0.7 and row["tokens"] == 8 and row["tau"] >= 1
    assert "| torch | 0.7 | q (rejection) |" in capsys.readouterr().out
