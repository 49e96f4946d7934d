"""MLX on a Linux CPU with the mlx[cpu] wheel's reference BLAS: an MLX CLI run restarts itself with OpenBLAS
preloaded where that is safe (no torch in the environment), says once in one line what to do where it is not, and
a torch run is never touched. The "OpenBLAS" here is a renamed copy of libm (preloading it changes nothing), and
an environment without torch is simulated by sys.modules["torch"] = None, which the restarted process repeats."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash import blas

pytestmark = pytest.mark.skipif(blas.wheel_reference_blas() is None,
                                reason="MLX here is not the mlx[cpu] wheel with its reference BLAS")


def run(*args, hide_torch: bool, **env):
    """`python -m dflash.generate ARGS`; every start of the interpreter prints its LD_PRELOAD to stderr first."""
    hide = "sys.modules['torch'] = None; " if hide_torch else ""
    code = (f"import os, runpy, sys; {hide}print('start LD_PRELOAD=' + os.environ.get('LD_PRELOAD', ''), "
            "file=sys.stderr); runpy.run_module('dflash.generate', run_name='__main__', alter_sys=True)")
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    p = subprocess.run([sys.executable, "-c", code, "--prompt-ids", "5,6,7", "--max-new-tokens", "2", "--json", *args],
                       capture_output=True, text=True, env={**base, "OMP_NUM_THREADS": "1", **env}, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["generation_tokens"] == 2
    lines = [ln for ln in p.stderr.splitlines() if not ln.startswith("[transformers]")]
    return [ln.removeprefix("start LD_PRELOAD=") for ln in lines if ln.startswith("start ")], \
        [ln for ln in lines if ln.startswith("dflash: ")]


@pytest.fixture
def openblas(tmp_path):
    """A preloadable stand-in: this interpreter's own libm under OpenBLAS's name."""
    maps = Path("/proc/self/maps").read_text().split()
    libm = next(Path(word) for word in maps if Path(word).name.startswith(("libm.so", "libm-")))
    fake = tmp_path / "libopenblas.so.0"
    shutil.copy(libm, fake)
    return str(fake)


def test_mlx_run_without_torch_restarts_with_openblas(openblas):
    starts, notices = run("--backend", "mlx", hide_torch=True, DFLASH_OPENBLAS=openblas)
    assert starts == ["", openblas] and notices == []


def test_mlx_run_without_openblas_says_what_to_install(tmp_path):
    starts, notices = run("--backend", "auto", hide_torch=True, DFLASH_OPENBLAS=str(tmp_path / "absent.so"))
    assert starts == [""]
    assert len(notices) == 1 and "reference BLAS" in notices[0] and "apt-get install libopenblas0-pthread" in notices[0]


def test_mlx_run_next_to_torch_is_not_preloaded(openblas):
    starts, notices = run("--backend", "mlx", hide_torch=False, DFLASH_OPENBLAS=openblas)
    assert starts == [""]
    assert len(notices) == 1 and "only where torch is not installed" in notices[0]


def test_torch_run_is_never_preloaded(openblas):
    starts, notices = run("--backend", "torch", hide_torch=False, DFLASH_OPENBLAS=openblas)
    assert starts == [""] and notices == []


def test_preloaded_openblas_is_left_alone(openblas, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", openblas)
    assert blas.mlx_blas() == "fast" and blas.advice("fast") is None
