"""Property-based: any config.json or safetensors input either loads or raises DFlashError, never anything else."""

import json
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash.core.model_files.checkpoint import read_header, validate_weights
from dflash.core.errors import DFlashError
from dflash.core.spec import DraftSpec

from test_spec import ZLAB

json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True) |
                           st.text(max_size=8), lambda c: st.lists(c, max_size=4) |
                           st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(ZLAB) + ["block_size", "rope_parameters", "extra"]), json_values,
                       max_size=12), st.booleans())
def test_any_config_loads_or_raises_dflash_error(overrides, start_from_valid):
    cfg = dict(ZLAB, **overrides) if start_from_valid else overrides
    try:
        DraftSpec.from_dict(cfg)
    except DFlashError as e:
        assert "\n" not in str(e)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300), header=st.one_of(st.none(), json_values))
def test_any_safetensors_bytes_load_or_raise_dflash_error(tmp_path, data, header):
    path = tmp_path / "model.safetensors"
    if header is not None:
        raw = json.dumps(header).encode()
        data = struct.pack("<Q", len(raw)) + raw + data
    path.write_bytes(data)
    try:
        read_header(path)
    except DFlashError as e:
        assert "\n" not in str(e)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["fc.weight", "norm.weight", "hidden_norm.weight", "layers.0.mlp.up_proj.weight",
                                        "model.fc.weight", "lm_head.weight"]),
                       st.lists(st.integers(0, 6), min_size=0, max_size=3), min_size=0, max_size=6))
def test_any_weight_set_validates_or_raises_dflash_error(tmp_path_factory, shapes):
    from safetensors.numpy import save_file
    import numpy as np

    d = tmp_path_factory.mktemp("w")
    spec = DraftSpec(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=2,
                     intermediate_size=6, vocab_size=10, num_target_layers=3, target_layer_ids=[1],
                     mask_token_id=9)
    save_file({k: np.zeros(s, dtype=np.float32) for k, s in shapes.items()}, str(d / "model.safetensors"))
    try:
        validate_weights(spec, d)
    except DFlashError as e:
        assert "\n" not in str(e)
