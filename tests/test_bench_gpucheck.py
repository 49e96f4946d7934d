import json

from dflash.bench.gpucheck import main


def test_small_shape_mode_runs_here(tmp_path):
    out = tmp_path / "report"
    assert main(["--small", "--skip-tests", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["training"]["step_seconds"] > 0
    assert {"8", "16"} <= set(report["cost_model"][0]["blocks"])
    assert "(T_draft+T_verify)/T_step" in out.with_suffix(".md").read_text()
    assert set(report["cost_model"][0]["trees"]["budgets"]) == {"1", "4", "8", "16"}  # tree verify per budget
    assert "## Tree verify" in out.with_suffix(".md").read_text()
