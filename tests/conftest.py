"""Shared fixtures: tiny models built on the spot (nothing is downloaded)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# device cost profiles (--verify auto) of the tiny test models stay out of the user's ~/.cache
os.environ.setdefault("DFLASH_CACHE_DIR", tempfile.mkdtemp(prefix="dflash-test-cache-"))

try:  # one intra-op thread: on a shared 2-core box, OpenMP threads spin against other processes (10-100x slower)
    import torch

    torch.set_num_threads(int(os.environ.get("DFLASH_TEST_THREADS", "1")))
except ImportError:
    pass


OPT_IN = {"real": "a real model (about 100 s on a CPU): run with pytest -m real",
          "slow": "a slow extra (a fresh venv's install, MLX runs of hybrid targets): run with pytest -m slow"}


def pytest_collection_modifyitems(config, items):
    """Real-model tests (minutes on a CPU) and slow extras run only when a -m expression names one of their markers
    (`-m real`, `-m slow`; .ci/run runs the slow ones after the default run), which stays within minutes."""
    asked = config.getoption("markexpr") or ""
    for item in items:
        markers = [m for m in OPT_IN if item.get_closest_marker(m) is not None]
        if markers[:1] == ["real"]:
            markers = ["real"]  # a real-model test runs only under -m real, even where it is slow too
        if markers and not all(m in asked for m in markers):
            item.add_marker(pytest.mark.skip(reason=OPT_IN[markers[0]]))


_terminal = None


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered
def pytest_configure(config):
    global _terminal
    if "PYTEST_XDIST_WORKER" not in os.environ:  # a worker's reports reach the controller, which prints them
        _terminal = config.pluginmanager.get_plugin("terminalreporter")


def pytest_runtest_logreport(report):
    """Name a failure the moment it happens: -q prints only `F`, and the summary of failures comes at the end, which
    a stopped run never reaches."""
    if report.failed and _terminal is not None:
        kind = "FAILED" if report.when == "call" else f"ERROR at {report.when} of"
        _terminal.write(f"\n{kind} {report.nodeid}\n", red=True, bold=True)  # -q's dots share the line




@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    from dflash.reference import tiny

    d = tmp_path_factory.mktemp("tokenizer")
    tiny.train_tokenizer(tiny.stdlib_sources(300_000), 512, d)
    return d


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A random 4-layer Qwen3 target (hidden 64) with a real BPE tokenizer and ChatML template."""
    from dflash.reference import tiny

    d = tmp_path_factory.mktemp("target")
    tiny.build_target(d, tiny_tokenizer_dir, seed=0)
    return d


@pytest.fixture(scope="session")
def random_draft_dir(tmp_path_factory, tiny_target_dir):
    """An untrained 2-layer drafter at block 16 for the tiny target (acceptance ~ 1)."""
    import torch

    from dflash.backends.torch.drafter import DFlashDrafter, save_drafter
    from dflash.reference import tiny

    d = tmp_path_factory.mktemp("draft")
    torch.manual_seed(1)
    save_drafter(DFlashDrafter(tiny.draft_spec_for(tiny_target_dir, num_layers=2, block_size=16)), d)
    return d


@pytest.fixture(scope="session")
def prompts(tiny_target_dir):
    """20 prompts of 8..40 tokens cut from standard-library source."""
    import random

    from transformers import AutoTokenizer

    from dflash.reference import tiny

    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    rng = random.Random(0)
    out = []
    for text in [t for t in tiny.stdlib_sources(400_000, seed=3) if len(t) > 2000][:20]:
        ids = tok(text)["input_ids"]
        n = rng.randint(8, 40)
        start = rng.randrange(0, max(1, len(ids) - n))
        out.append(ids[start:start + n])
    return out


# what the trained pair is made of: a change to any of these builds it again
PAIR_SOURCES = ("dflash/core", "dflash/reference", "backends/torch", "tests/tiny_pair.py")


def pair_version() -> str:
    import torch
    import transformers

    h = hashlib.sha256(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    for source in PAIR_SOURCES:
        path = ROOT / source
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def trained_pair(request):
    """(target_dir, draft_dir) of a tiny target and a drafter trained for it in ~40 s with the real trainer, whose
    mean acceptance length at block 16 on held-out prompts is >= 3 (asserted here; info in draft_dir/../../pair.json).
    The target's greedy continuations follow learnable structure (see tests/tiny_pair.py).

    Built once, not once per xdist worker: the first worker to get the lock builds it into pytest's cache directory,
    keyed by the version of the code it is made of; the others, and later runs of the same code, load it."""
    from tiny_pair import build_trained_pair

    cache = request.config.cache.mkdir("trained-pair")
    root = cache / pair_version()
    with open(cache / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the holder is killed
        if not (root / "pair.json").is_file():  # written last: without it, what is there is a killed build's
            shutil.rmtree(root, ignore_errors=True)
            build_trained_pair(root)
    target_dir, draft_dir, info = build_trained_pair(root)
    assert info["tau"] >= 3.0, f"trained_pair fixture: held-out tau {info['tau']:.2f} < 3"
    return target_dir, draft_dir


@pytest.fixture(scope="session")
def dflash2_pair(tmp_path_factory, trained_pair):
    """(target_dir, draft_dir): the trained pair's drafter as a DFlash2 drafter in the public layout (identity
    convolutions with a little noise, random codebooks of rank 16): long acceptances with partial ones among them."""
    from dflash.backends.torch.drafter import load_drafter, save_drafter
    from dflash.reference import tiny
    from tiny_pair import dflash2_from

    target_dir, draft_dir = trained_pair
    source = load_drafter(draft_dir)
    d = tmp_path_factory.mktemp("dflash2")
    save_drafter(dflash2_from(source, tiny.dflash2_spec(source.spec), conv_noise=0.02, selector_scale=0.3), d)
    return target_dir, d


@pytest.fixture(scope="session")
def random_dflash2_dir(tmp_path_factory, tiny_target_dir):
    """An untrained DFlash2 drafter (block 8, sliding window 16: shorter than the prompts' contexts) whose
    convolutions and selector are far from the identity."""
    import torch

    from dflash.backends.torch.drafter import DFlashDrafter, save_drafter
    from dflash.reference import tiny
    from tiny_pair import dflash2_from

    torch.manual_seed(2)
    spec = tiny.draft_spec_for(tiny_target_dir, num_layers=2, block_size=8)
    d = tmp_path_factory.mktemp("dflash2_random")
    save_drafter(dflash2_from(DFlashDrafter(spec), tiny.dflash2_spec(spec, sliding_window=16), conv_noise=0.3,
                              selector_scale=1.0, seed=3), d)
    return d


class ServerProcess:
    """A `python -m dflash.serve` process on a free 127.0.0.1 port (the bundled pair unless args say otherwise)."""

    def __init__(self, log_path, *args: str):
        import socket
        import subprocess
        import sys

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash.serve", "--port", str(self.port), *args],
                                     stdout=subprocess.DEVNULL, stderr=open(log_path, "w"), env=env)

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"dflash.serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"dflash.serve not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return open(self.log_path).read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except Exception:
                self.proc.kill()


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(*args) -> a ready ServerProcess; every one started is stopped at the end of the session."""
    started = []

    def start(*args: str) -> ServerProcess:
        s = ServerProcess(tmp_path_factory.mktemp("serve") / "server.log", *args)
        started.append(s)
        return s.wait_ready()

    yield start
    for s in started:
        s.stop()
