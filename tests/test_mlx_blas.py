"""MLX on a Linux CPU with the mlx[cpu] wheel's reference BLAS: an MLX CLI run restarts itself with OpenBLAS
preloaded where that is safe (no torch in the environment), says once in one line what to do where it is not, and
a torch run is never touched. The "OpenBLAS" here is a renamed copy of libm (preloading it changes nothing), and
an environment without torch is simulated by sys.modules["torch"] = None in a sitecustomize, which the restarted
process runs again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.core.extras import blas

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(blas.wheel_reference_blas() is None,
                                reason="MLX here is not the mlx[cpu] wheel with its reference BLAS")


def start(tmp_path, command: list, hide_torch: bool, stdin: str | None = None, **env):
    """`python COMMAND` as a user types it; a sitecustomize makes every start of the interpreter (the restart too)
    print its LD_PRELOAD to stderr and, with hide_torch, lose torch. Returns (process, LD_PRELOAD of every start)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import os, sys\n" + ("sys.modules['torch'] = None\n" if hide_torch else "") +
        "print('start LD_PRELOAD=' + os.environ.get('LD_PRELOAD', ''), file=sys.stderr)\n")
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    path = os.pathsep.join([str(site), str(ROOT), base.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    p = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=300, input=stdin,
                       env={**base, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **env})
    assert p.returncode == 0, p.stderr
    return p, [ln.removeprefix("start LD_PRELOAD=") for ln in p.stderr.splitlines() if ln.startswith("start ")]


def run(tmp_path, *args, hide_torch: bool, **env):
    """`python -m dflash.generate ARGS --json` (two tokens): (LD_PRELOAD of every start, BLAS notices)."""
    p, starts = start(tmp_path, ["-m", "dflash.generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "2", "--json",
                                 *args], hide_torch, **env)
    assert json.loads(p.stdout)["generation_tokens"] == 2
    return starts, [ln for ln in p.stderr.splitlines() if ln.startswith("dflash: ")
                    and "verify costs" not in ln
                    and not ln.startswith(("dflash: measured in ", "dflash: still "))]
    # (the --verify auto profile's own notice, when the slow reference BLAS makes it take over a second, and the
    # progress lines of a slow load are not BLAS notices)


@pytest.fixture
def openblas(tmp_path):
    """A preloadable stand-in: this interpreter's own libm under OpenBLAS's name."""
    maps = Path("/proc/self/maps").read_text().split()
    libm = next(Path(word) for word in maps if Path(word).name.startswith(("libm.so", "libm-")))
    fake = tmp_path / "libopenblas.so.0"
    shutil.copy(libm, fake)
    return str(fake)


def test_mlx_run_without_torch_restarts_with_openblas(openblas, tmp_path):
    starts, notices = run(tmp_path, "--backend", "mlx", hide_torch=True, DFLASH_OPENBLAS=openblas)
    assert starts == ["", openblas] and notices == []


@pytest.mark.parametrize("backend", [["--backend", "mlx"], []])
def test_piped_mlx_chat_restarts_before_reading_stdin(openblas, tmp_path, backend):
    """The restarted process reads the piped prompt: the first one must not have consumed it."""
    p, starts = start(tmp_path, ["-m", "dflash.chat", *backend, "--max-new-tokens", "4"], hide_torch=True,
                      stdin="def f(x):\n", DFLASH_OPENBLAS=openblas)
    assert starts == ["", openblas]
    assert "tau " in p.stderr and "empty prompt" not in p.stderr and "PyTorch was not found" not in p.stderr


def test_mlx_run_without_openblas_says_what_to_install(tmp_path):
    starts, notices = run(tmp_path, "--backend", "auto", hide_torch=True, DFLASH_OPENBLAS=str(tmp_path / "absent.so"))
    assert starts == [""]
    assert len(notices) == 1 and "reference BLAS" in notices[0] and "apt-get install libopenblas0-pthread" in notices[0]


def test_mlx_run_next_to_torch_is_not_preloaded(openblas, tmp_path):
    starts, notices = run(tmp_path, "--backend", "mlx", hide_torch=False, DFLASH_OPENBLAS=openblas)
    assert starts == [""]
    assert len(notices) == 1 and "only where torch is not installed" in notices[0]


def test_torch_run_is_never_preloaded(openblas, tmp_path):
    starts, notices = run(tmp_path, "--backend", "torch", hide_torch=False, DFLASH_OPENBLAS=openblas)
    assert starts == [""] and notices == []


def test_preloaded_openblas_is_left_alone(openblas, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", openblas)
    assert blas.mlx_blas() == "fast" and blas.advice("fast") is None


def test_a_script_calling_a_cli_main_is_not_restarted(openblas, monkeypatch, capsys):
    """Only `python -m dflash.<cli>` is re-executed; a script (here: pytest) is told how to start the process."""
    monkeypatch.setattr(blas, "mlx_blas", lambda: "preloadable")
    monkeypatch.setattr(blas, "_told", False)
    monkeypatch.setenv("DFLASH_OPENBLAS", openblas)
    monkeypatch.setattr(blas.os, "execve", lambda *a: pytest.fail(f"restarted: {a}"))
    blas.restart_mlx_run_with_openblas()
    blas.tell_once(blas.advice(blas.mlx_blas()))  # what dflash.load says
    assert capsys.readouterr().err.strip().endswith(f"start the process with LD_PRELOAD={openblas}")


def test_a_refused_mlx_run_prints_only_its_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "dflash.generate", "--backend", "mlx", "--model", tmp_path / "nope",
                        "--prompt", "x"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and p.stderr.startswith("error: --model"), p.stderr


def test_a_preload_named_otherwise_is_recognised(tmp_path, monkeypatch):
    """DFLASH_OPENBLAS may name a build without "openblas" in its file name; its preload still counts."""
    other = tmp_path / "libblas-optimised.so.3"
    other.write_bytes(b"")
    monkeypatch.setenv("DFLASH_OPENBLAS", str(other))
    monkeypatch.setenv("LD_PRELOAD", str(other))
    assert blas.openblas_preloaded() and blas.mlx_blas() == "fast"
