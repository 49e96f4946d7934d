import json

from dflash.bench.costmodel import expected_tau, main


def test_expected_tau():
    curve = [0.9, 0.8, 0.5, 0.1]
    assert expected_tau(curve, 2) == 1.9
    assert abs(expected_tau(curve, 5) - 3.3) < 1e-9


def test_cost_model_runs_at_tiny_shape(tmp_path, capsys):
    cfg = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, vocab_size=512)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "curve.json").write_text(json.dumps([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]))
    out = tmp_path / "cost.json"
    assert main(["--target-config", str(tmp_path / "config.json"), "--draft-layers", "2", "--block-sizes", "4", "8",
                 "--context", "32", "--iters", "3", "--warmup", "1", "--tau", "3", "--acceptance",
                 str(tmp_path / "curve.json"), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["blocks"]) == {"4", "8"} and res["t_step"] > 0
    assert res["best_block_size"] in (4, 8)
    assert "best block size" in capsys.readouterr().out
