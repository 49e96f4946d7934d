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


def test_cost_model_tree_budgets(tmp_path, capsys):
    cfg = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, vocab_size=512)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    curve = {"rows": [{"kind": "chain", "budget": 7, "tau": 3.0}, {"kind": "tree", "budget": 4, "tau": 3.5},
                      {"kind": "tree", "budget": 16, "tau": 5.0}]}
    (tmp_path / "curve.json").write_text(json.dumps(curve))
    out = tmp_path / "cost.json"
    assert main(["--target-config", str(tmp_path / "config.json"), "--draft-layers", "1", "--block-sizes", "8",
                 "--context", "16", "--iters", "2", "--warmup", "1", "--tree-budgets", "1", "4", "16",
                 "--tree-curve", str(tmp_path / "curve.json"), "--json", str(out)]) == 0
    trees = json.loads(out.read_text())["trees"]
    assert set(trees["budgets"]) == {"1", "4", "16"} and trees["best_budget"] in (4, 16)
    assert trees["budgets"]["16"]["t_verify"] >= trees["budgets"]["1"]["t_verify"]  # measured, made monotone
    assert "speedup" in trees["budgets"]["4"] and "speedup" not in trees["budgets"]["1"]
    assert "best tree budget" in capsys.readouterr().out


def test_cost_model_times_a_dflash2_drafter(tmp_path):
    cfg = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, vocab_size=512)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "cost.json"
    assert main(["--target-config", str(tmp_path / "config.json"), "--draft-layers", "1", "--block-sizes", "8",
                 "--context", "16", "--iters", "2", "--warmup", "1", "--arch", "dflash2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["arch"] == "dflash2" and res["blocks"]["8"]["t_cycle"] > 0



def test_smollm2_is_a_bundled_shape():
    """cost-model --model smollm2 times SmolLM2-135M's shape with random weights: nothing to fetch."""
    from dflash.bench.costmodel import load_config

    c = load_config("smollm2")
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size, c.vocab_size) == ("llama", 30, 576, 9, 3, 64, 1536, 49152)
