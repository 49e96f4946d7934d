"""Shared fixtures: tiny models built on the spot (nothing is downloaded)."""

from __future__ import annotations

import os
import tempfile

import pytest

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


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    from dflash import tiny

    d = tmp_path_factory.mktemp("tokenizer")
    tiny.train_tokenizer(tiny.stdlib_sources(300_000), 512, d)
    return d


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A random 4-layer Qwen3 target (hidden 64) with a real BPE tokenizer and ChatML template."""
    from dflash import tiny

    d = tmp_path_factory.mktemp("target")
    tiny.build_target(d, tiny_tokenizer_dir, seed=0)
    return d


@pytest.fixture(scope="session")
def random_draft_dir(tmp_path_factory, tiny_target_dir):
    """An untrained 2-layer drafter at block 16 for the tiny target (acceptance ~ 1)."""
    import torch

    from dflash import tiny
    from dflash.backends.torch.drafter import DFlashDrafter, save_drafter

    d = tmp_path_factory.mktemp("draft")
    torch.manual_seed(1)
    save_drafter(DFlashDrafter(tiny.draft_spec_for(tiny_target_dir, num_layers=2, block_size=16)), d)
    return d


@pytest.fixture(scope="session")
def prompts(tiny_target_dir):
    """20 prompts of 8..40 tokens cut from standard-library source."""
    import random

    from transformers import AutoTokenizer

    from dflash import tiny

    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    rng = random.Random(0)
    out = []
    for text in [t for t in tiny.stdlib_sources(400_000, seed=3) if len(t) > 2000][:20]:
        ids = tok(text)["input_ids"]
        n = rng.randint(8, 40)
        start = rng.randrange(0, max(1, len(ids) - n))
        out.append(ids[start:start + n])
    return out


@pytest.fixture(scope="session")
def trained_pair(tmp_path_factory):
    """(target_dir, draft_dir) of a tiny target and a drafter trained for it in ~40 s with the real trainer, whose
    mean acceptance length at block 16 on held-out prompts is >= 3 (asserted here; info in draft_dir/../../pair.json).
    The target's greedy continuations follow learnable structure (see backends/torch/tiny_pair.py)."""
    from dflash.backends.torch.tiny_pair import build_trained_pair

    target_dir, draft_dir, info = build_trained_pair(tmp_path_factory.mktemp("trained_pair"))
    assert info["tau"] >= 3.0, f"trained_pair fixture: held-out tau {info['tau']:.2f} < 3"
    return target_dir, draft_dir


@pytest.fixture(scope="session")
def dflash2_pair(tmp_path_factory, trained_pair):
    """(target_dir, draft_dir): the trained pair's drafter as a DFlash2 drafter in the public layout (identity
    convolutions with a little noise, random codebooks of rank 16): long acceptances with partial ones among them."""
    from dflash import tiny
    from dflash.backends.torch.drafter import load_drafter, save_drafter
    from dflash.backends.torch.tiny_pair import dflash2_from

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

    from dflash import tiny
    from dflash.backends.torch.drafter import DFlashDrafter, save_drafter
    from dflash.backends.torch.tiny_pair import dflash2_from

    torch.manual_seed(2)
    spec = tiny.draft_spec_for(tiny_target_dir, num_layers=2, block_size=8)
    d = tmp_path_factory.mktemp("dflash2_random")
    save_drafter(dflash2_from(DFlashDrafter(spec), tiny.dflash2_spec(spec, sliding_window=16), conv_noise=0.3,
                              selector_scale=1.0, seed=3), d)
    return d
