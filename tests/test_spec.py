import json

import pytest

from dflash.core.errors import DFlashError
from dflash.core.spec import DraftSpec, TargetInfo, check_block_size, default_target_layer_ids

# the shape of a public z-lab drafter config (Qwen3-8B-DFlash-b16), extra keys included
ZLAB = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16", "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960,
    "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 5,
    "num_key_value_heads": 8, "num_target_layers": 36, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_8B = TargetInfo(hidden_size=4096, num_hidden_layers=36, vocab_size=151936)


def test_public_config_parses_and_validates():
    spec = DraftSpec.from_dict(ZLAB)
    assert spec.block_size == 16 and spec.mask_token_id == 151669
    assert spec.target_layer_ids == [1, 9, 17, 25, 33]
    assert spec.extra["auto_map"] == ZLAB["auto_map"]  # unknown keys kept
    spec.validate_against(QWEN3_8B)


def test_round_trip_keeps_extra_keys(tmp_path):
    spec = DraftSpec.from_dict(ZLAB)
    spec.save(tmp_path)
    again = DraftSpec.load(tmp_path)
    assert again == spec
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"] == ZLAB["auto_map"]


def test_block_size_inside_dflash_config_and_rope_parameters():
    cfg = {k: v for k, v in ZLAB.items() if k not in ("block_size", "rope_theta")}
    cfg["dflash_config"] = dict(cfg["dflash_config"], block_size=10)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    spec = DraftSpec.from_dict(cfg)
    assert spec.block_size == 10 and spec.rope_theta == 500000.0


def test_default_layer_ids_match_public_drafter():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]


@pytest.mark.parametrize("change, field", [
    ({"hidden_size": 2048}, "hidden_size"),
    ({"num_target_layers": 28}, "num_target_layers"),
    ({"vocab_size": 1000}, "vocab_size"),
    ({"dflash_config": {"mask_token_id": 151936, "target_layer_ids": [1, 9, 17, 25, 33]}}, "mask_token_id"),
])
def test_mismatch_with_target_names_the_field(change, field):
    cfg = dict(ZLAB, **change)
    if field == "hidden_size":
        cfg["intermediate_size"] = 1
    with pytest.raises(DFlashError, match=field):
        DraftSpec.from_dict(cfg).validate_against(QWEN3_8B)


def test_layer_id_out_of_range():
    cfg = dict(ZLAB, num_target_layers=-1)
    cfg.pop("num_target_layers")
    cfg["dflash_config"] = {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 36]}
    with pytest.raises(DFlashError, match=r"target_layer_ids \[36\]"):
        DraftSpec.from_dict(cfg).validate_against(QWEN3_8B)


@pytest.mark.parametrize("drop", ["hidden_size", "vocab_size", "dflash_config"])
def test_missing_field(drop):
    cfg = {k: v for k, v in ZLAB.items() if k != drop}
    with pytest.raises(DFlashError, match="missing required field"):
        DraftSpec.from_dict(cfg)


def test_wrong_architecture():
    with pytest.raises(DFlashError, match="architectures"):
        DraftSpec.from_dict(dict(ZLAB, architectures=["Qwen3ForCausalLM"]))


def test_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DFlashError, match="not valid JSON"):
        DraftSpec.load(tmp_path)


def test_block_size_bounds():
    spec = DraftSpec.from_dict(ZLAB)
    check_block_size(8, spec)
    for bad in (1, 17):
        with pytest.raises(DFlashError, match="--block-size"):
            check_block_size(bad, spec)


# the shape of a public DFlash2 drafter config (the format of DFlash2DraftModel), extra keys included
DFLASH2 = {
    "architectures": ["DFlash2DraftModel"], "attention_bias": False, "dtype": "bfloat16", "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "is_causal": False,
    "layer_types": ["sliding_attention"] * 5, "max_position_embeddings": 262144, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 36,
    "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
    "sliding_window": 2048, "tie_word_embeddings": False, "vocab_size": 151936,
    "dflash_config": {"block_size": 16, "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                      "selector_top_k": 16, "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33],
                      "attention_mode": "gqa"},
}


def test_dflash2_config_parses_and_round_trips(tmp_path):
    spec = DraftSpec.from_dict(DFLASH2)
    assert spec.is_dflash2 and spec.block_size == 16 and spec.rope_theta == 1e7
    assert (spec.conv_kernel_size, spec.conv_group_size, spec.selector_rank, spec.selector_top_k) == (2, 16, 256, 16)
    assert [spec.window_for_layer(i) for i in range(5)] == [2048] * 5
    assert not any(spec.causal_for_layer(i) for i in range(5))  # is_causal: false
    assert spec.logit_scaling() == (1.0, None) and spec.input_embedding_scale is None
    spec.validate_against(QWEN3_8B)
    spec.save(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["DFlash2DraftModel"]
    assert written["dflash_config"]["attention_mode"] == "gqa"  # unread dflash_config keys kept
    assert written["rope_parameters"]["rope_theta"] == 1e7
    assert DraftSpec.load(tmp_path) == spec


@pytest.mark.parametrize("arch", ["DFlashDraftModel", "DFlash2DraftModel"])
def test_logit_and_embedding_scales_are_read(arch):
    cfg = json.loads(json.dumps(DFLASH2 if arch == "DFlash2DraftModel" else ZLAB))
    cfg["dflash_config"].update(output_multiplier=0.5, final_logit_softcapping=30.0, input_embedding_scale=64.0)
    spec = DraftSpec.from_dict(cfg)
    assert spec.logit_scaling() == (0.5, 30.0) and spec.input_embedding_scale == 64.0
    assert DraftSpec.from_dict(spec.to_dict()) == spec
    gemma = TargetInfo(hidden_size=4096, num_hidden_layers=36, vocab_size=151936, final_logit_softcapping=25.0)
    assert spec.logit_scaling(gemma) == (0.5, 30.0)  # its own win
    assert DraftSpec.from_dict(ZLAB).logit_scaling(gemma) == (1.0, 25.0)  # none of its own: the target's


@pytest.mark.parametrize("change, field", [
    ({"selector_rank": None}, "dflash_config.selector_rank"),
    ({"conv_kernel_size": "2"}, "dflash_config.conv_kernel_size"),
    ({"conv_group_size": 48}, "dflash_config.conv_group_size"),
    ({"selector_top_k": 0}, "dflash_config.selector_top_k"),
    ({"final_logit_softcapping": -1.0}, "dflash_config.final_logit_softcapping"),
])
def test_dflash2_bad_field_is_one_line_naming_it(change, field):
    cfg = json.loads(json.dumps(DFLASH2))
    cfg["dflash_config"].update(change)
    cfg["dflash_config"] = {k: v for k, v in cfg["dflash_config"].items() if v is not None}
    with pytest.raises(DFlashError) as e:
        DraftSpec.from_dict(cfg)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_unknown_drafter_architecture_names_both_known_ones():
    with pytest.raises(DFlashError) as e:
        DraftSpec.from_dict(dict(DFLASH2, architectures=["DFlash3DraftModel"]))
    assert all(a in str(e.value) for a in ("DFlash3DraftModel", "DFlashDraftModel", "DFlash2DraftModel"))
