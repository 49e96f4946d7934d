"""dflash.core.model_files.target_config: the RoPE keys a transformers-5 config keeps inside `rope_parameters`, also written at
the top level where older readers (mlx-lm's ModelArgs) look. For each layout transformers reads the same model
before and after, and mlx-lm then reads what transformers reads (converters/readings.py parses both)."""

from __future__ import annotations

import copy
import json

import pytest

from dflash.converters import readings
from dflash.core.model_files.target_config import legacy_fields, with_legacy_fields, write_legacy_fields

# SmolLM2-135M-Instruct's config.json as `python -m dflash.models fetch smollm2` wrote it under transformers 5.24
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "dtype": "float32", "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu", "hidden_size": 576,
    "initializer_range": 0.02, "intermediate_size": 1536, "max_position_embeddings": 8192, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
    "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 9.999999747378752e-06,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": True,
    "transformers_version": "5.24.0", "unk_token_id": 0, "use_cache": True, "vocab_size": 49152,
}
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, vocab_size=512, rms_norm_eps=1e-5, max_position_embeddings=4096,
             tie_word_embeddings=False)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
CONFIGS = {
    "smollm2": SMOLLM2,
    "llama3.1 scaling": {"model_type": "llama", **SMALL, "rope_parameters": LLAMA3},
    "linear scaling": {"model_type": "llama", **SMALL,
                       "rope_parameters": {"rope_type": "linear", "rope_theta": 20000.0, "factor": 2.0}},
    "yarn": {"model_type": "llama", **SMALL, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": 32.0, "beta_slow": 1.0}},
    "qwen3_moe": {"model_type": "qwen3_moe", **SMALL, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "norm_topk_prob": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    # rope_theta inside rope_parameters wins over a stale top-level one, for transformers and so for mlx-lm
    "conflicting theta": {"model_type": "llama", **SMALL, "rope_theta": 10000.0,
                          "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
    "old layout": {"model_type": "llama", **SMALL, "rope_theta": 100000.0},
}


def written(tmp_path, config: dict):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("name", CONFIGS)
def test_transformers_reads_the_same_model_and_mlx_lm_reads_it_too(tmp_path, name):
    config = CONFIGS[name]
    before = readings.transformers_reading(written(tmp_path / "before", config))
    fixed = with_legacy_fields(config)
    assert readings.transformers_reading(written(tmp_path / "after", fixed)) == before
    assert config == CONFIGS[name]  # a copy: the input is not changed
    pytest.importorskip("mlx_lm")
    assert readings.differences(before, readings.mlx_reading(fixed, name)) == []


def test_the_transformers_5_layout_is_what_mlx_lm_misreads(tmp_path):
    """mlx-lm 0.32's llama ModelArgs on SmolLM2's transformers-5 config: the theta of its own default."""
    pytest.importorskip("mlx_lm")
    reference = readings.transformers_reading(written(tmp_path, SMOLLM2))
    assert readings.differences(reference, readings.mlx_reading(SMOLLM2, "smollm2")) == [
        "rope_theta 10000 (transformers: 100000)"]


def test_legacy_fields():
    assert legacy_fields(SMOLLM2) == {"rope_theta": 100000.0}  # a default rope type needs no rope_scaling
    llama3 = legacy_fields(CONFIGS["llama3.1 scaling"])
    assert llama3["rope_theta"] == 500000.0 and llama3["rope_scaling"] == LLAMA3
    assert legacy_fields(CONFIGS["old layout"]) == {}
    per_layer_type = {"model_type": "gemma4_text", "layer_types": ["sliding_attention", "full_attention"],
                      "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}
    assert legacy_fields(per_layer_type) == {}  # no single RoPE to mirror
    # a multimodal config: its text_config (Qwen3.5 rotates a quarter of each head)
    qwen35 = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}}}
    text = with_legacy_fields(qwen35)["text_config"]
    assert text["rope_theta"] == 10000000.0 and text["partial_rotary_factor"] == 0.25


def test_write_legacy_fields_in_place(tmp_path):
    d = written(tmp_path, SMOLLM2)
    assert write_legacy_fields(d) is True
    saved = json.loads((d / "config.json").read_text())
    assert saved == {**SMOLLM2, "rope_theta": 100000.0}
    assert write_legacy_fields(d) is False  # already there: the file is left alone
    assert json.loads((d / "config.json").read_text()) == saved == with_legacy_fields(copy.deepcopy(saved))
