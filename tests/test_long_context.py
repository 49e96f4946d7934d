"""Long prompts: chunked prefill completes an 8K-token prompt with bounded peak memory, and stays exact."""

import json
import subprocess
import sys

import pytest
torch = pytest.importorskip("torch")

RSS = """
import json, resource, sys
from dflash.api import load
pipe = load(sys.argv[1], sys.argv[2], backend="torch", device="cpu")
n = int(sys.argv[3])
ids = [(i * 7919) % 500 + 3 for i in range(n)]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
r = pipe.generate(ids, max_new_tokens=16)
print(json.dumps({"n": n, "tokens": r.tokens, "base_mb": base / 1024,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "prefill_s": r.prefill_seconds}))
"""


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory, tiny_tokenizer_dir):
    from dflash.backends.torch.drafter import DFlashDrafter, save_drafter
    from dflash.reference import tiny

    d = tmp_path_factory.mktemp("long")
    tiny.build_target(d / "target", tiny_tokenizer_dir, max_position_embeddings=16384)
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(tiny.draft_spec_for(d / "target", num_layers=2)), d / "draft")
    return d / "target", d / "draft"


@pytest.mark.slow
def test_8k_prompt_peak_memory_is_bounded(long_pair):
    target, draft = long_pair
    runs = {}
    for n in (1024, 8192):
        p = subprocess.run([sys.executable, "-c", RSS, str(target), str(draft), str(n)], capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        runs[n] = json.loads(p.stdout.strip().splitlines()[-1])
    grow = runs[8192]["peak_mb"] - runs[1024]["peak_mb"]
    print({n: round(r["peak_mb"]) for n, r in runs.items()}, "MB")
    assert len(runs[8192]["tokens"]) == 16
    assert grow < 400, f"peak RSS grew {grow:.0f} MB from 1K to 8K tokens"  # chunks of 2048 bound the transients


def test_chunked_prefill_is_exact_on_long_prompt(long_pair):
    from dflash.backends.torch.backend import torch_engine
    from dflash.backends.torch.drafter import load_drafter
    from dflash.backends.torch.target import load_target
    from dflash.core.loop import generate

    target, draft = long_pair
    model = load_target(target, torch.float32, "cpu")
    ids = [(i * 7919) % 500 + 3 for i in range(3000)]
    whole = generate(torch_engine(model, load_drafter(draft), prefill_chunk=4096), ids, max_new_tokens=24)
    chunked = generate(torch_engine(model, load_drafter(draft), prefill_chunk=512), ids, max_new_tokens=24)
    base = generate(torch_engine(model), ids, max_new_tokens=24)
    assert whole.tokens == chunked.tokens == base.tokens
