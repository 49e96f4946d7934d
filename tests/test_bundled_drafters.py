"""The drafters that ship in the package (dflash/drafters/): found by their target's name, shaped for it, small,
and in the public checkpoint format (bfloat16 safetensors without the target's embedding or LM head)."""

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from dflash import hub
from dflash.core.spec import DraftSpec, TargetInfo

CONFIGS = Path(__file__).resolve().parents[1] / "dflash" / "bench" / "configs"
TARGETS = {"smollm2-dflash": "smollm2"}  # bundled drafter -> the prepared target it was trained for


@pytest.mark.parametrize("name", sorted(hub.BUNDLED_DRAFTERS))
def test_bundled_drafter(name):
    directory = hub.BUNDLED_DRAFTERS[name]
    target = TARGETS[name]
    assert hub.resolve(name, "--draft") == directory and hub.draft_for(target) == name
    shape = json.loads((CONFIGS / f"{target}.json").read_text())
    spec = DraftSpec.load(directory)
    spec.validate_against(TargetInfo(hidden_size=shape["hidden_size"], num_hidden_layers=shape["num_hidden_layers"],
                                     vocab_size=shape["vocab_size"], model_type=shape["model_type"],
                                     rope_theta=shape["rope_theta"]), source=name)
    weights = directory / "model.safetensors"
    assert weights.stat().st_size <= 40 * 2**20
    with safe_open(str(weights), framework="numpy") as f:
        keys = list(f.keys())
    assert keys and not any("embed_tokens" in k or "lm_head" in k for k in keys)
    header = json.loads(weights.read_bytes()[8:8 + int.from_bytes(weights.read_bytes()[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
