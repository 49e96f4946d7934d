"""`python -m dflash.train` answers --help and flag errors before importing torch, and says in one line when torch
is missing (simulated: a meta-path finder that refuses `torch`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")

NO_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named 'torch'")
sys.meta_path.insert(0, NoTorch())
from dflash import cli
from dflash.train import main
sys.exit(cli.run(main, sys.argv[1:]))
"""


def run_train(*args, code=None):
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "dflash.train", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)


def test_help_lists_real_defaults_only_once():
    r = run_train("--help", code=NO_TORCH)  # no torch needed to ask for help
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "(default )" not in out and "(default None)" not in out
    assert "--kl-weight" in out and "--draft-window" in out
    for line in out.split("--")[1:]:
        assert line.count("(default") <= 1, line
    assert "(default 16)" in out  # --block-size


def test_missing_torch_is_one_line(tmp_path):
    r = run_train("--model", str(tmp_path), "--data", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "o"),
                  code=NO_TORCH)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "torch is not installed" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_flag_errors_come_before_torch(tmp_path):
    r = run_train("--model", str(tmp_path), "--num-layers", "two", code=NO_TORCH)
    assert r.returncode == 2 and r.stderr.strip() == "error: --num-layers: cannot read 'two' as int"


def test_paper_recipe_is_one_flag_away_and_flags_override_it():
    from dflash.core.training.train_config import TrainConfig
    from dflash.train import config_from_args, parse_args

    default = config_from_args(parse_args(["--model", "m"]))
    assert (default.init_layers, default.kl_weight) == (TrainConfig().init_layers, TrainConfig().kl_weight)
    paper = config_from_args(parse_args(["--model", "m", "--recipe", "paper"]))
    assert (paper.init_layers, paper.kl_weight) == ("random", 0.0)
    mixed = config_from_args(parse_args(["--model", "m", "--recipe", "paper", "--kl-weight", "0.25"]))
    assert (mixed.init_layers, mixed.kl_weight) == ("random", 0.25)


def test_soft_loss_is_one_of_the_known_terms():
    pytest.importorskip("torch")
    from dflash.backends.torch.training.run import check_config
    from dflash.core.errors import DFlashError
    from dflash.train import config_from_args, parse_args

    cfg = config_from_args(parse_args(["--model", "m", "--kl-weight", "1", "--soft-loss", "lk"]))
    assert cfg.soft_loss == "lk"
    check_config(cfg)
    with pytest.raises(DFlashError, match="--soft-loss: got 'tv', expected one of kl, lk"):
        check_config(config_from_args(parse_args(["--model", "m", "--soft-loss", "tv"])))
