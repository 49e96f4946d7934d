"""The MLX-only install of the docs, for real: a venv without system packages, `pip install -e ".[mlx]"` (no torch,
no matplotlib), then the commands a user tries first. About 30 s with a warm pip cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NETWORK = ("Failed to establish a new connection", "Temporary failure in name resolution", "Network is unreachable")

pytestmark = [pytest.mark.slow, pytest.mark.mlx,
              pytest.mark.skipif(sys.platform not in ("linux", "darwin"), reason="mlx wheels: Linux and macOS")]


def fresh_venv(env_dir: Path, extras: str) -> Path:
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    p = subprocess.run([python, "-m", "pip", "install", "-q", "-e", f"{ROOT}[{extras}]"], capture_output=True,
                       text=True, timeout=900)
    if p.returncode and any(n in p.stderr for n in NETWORK):
        pytest.skip(f"no package index reachable: {p.stderr.strip().splitlines()[-1]}")
    assert p.returncode == 0, p.stderr
    return python


@pytest.fixture(scope="module")
def mlx_only(tmp_path_factory):
    return fresh_venv(tmp_path_factory.mktemp("mlx-only-venv"), "mlx")


def run(python, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    return subprocess.run([python, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=ROOT.parent,
                          env=dict(env, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", DFLASH_OPENBLAS="/nonexistent"))


def one_error_line(p) -> str:
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, p.stderr
    return errors[0]


def test_the_venv_has_no_torch(mlx_only):
    assert run(mlx_only, "-c", "import torch").returncode == 1
    assert run(mlx_only, "-c", "import dflash.generate, mlx_lm").returncode == 0


def test_the_suite_collects_without_torch(tmp_path):
    """With the MLX and test extras but no torch, test files that need torch skip themselves; none fails to import."""
    python = fresh_venv(tmp_path / "venv", "mlx,test")
    assert run(python, "-c", "import torch").returncode == 1
    p = run(python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", ROOT / "tests")
    summary = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    assert p.returncode == 0 and "collected" in summary and "error" not in summary, p.stdout[-3000:] + p.stderr[-2000:]
    assert "tests/test_mlx_backend.py::" in p.stdout  # the MLX tests are collected, not skipped wholesale


def test_generate_picks_mlx(mlx_only):
    p = run(mlx_only, "-m", "dflash.generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["generation_tokens"] == 3


def test_what_needs_torch_says_so(mlx_only, tmp_path):
    line = one_error_line(run(mlx_only, "-m", "dflash.bench", "cost-model"))
    assert "needs the 'torch' package" in line
    line = one_error_line(run(mlx_only, "-m", "dflash.generate", "--backend", "torch", "--prompt", "x"))
    assert "--backend torch" in line and "'torch' package is not installed" in line
    line = one_error_line(run(mlx_only, "-m", "dflash.bench", "--methods", "dflash_b16", "--out", tmp_path / "b"))
    assert "--methods" in line and not (tmp_path / "b").exists()
