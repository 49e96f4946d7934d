"""The target model: any transformers causal LM, loaded with the target's attention, with hooks that capture only the
layers the drafter reads.

The target's attention (`GROUPED_SDPA`) is transformers' SDPA, except that a grouped-query forward of several tokens
under a mask (a batch's cycle, a tree verify) runs on the key/value heads, each group's query heads stacked along the
query axis, instead of on keys and values repeated for every query head.

transformers repeats K/V in that case (it keeps the fused CUDA kernels, which refuse a mask with grouped heads), which
copies the whole cache once per query head per layer: on a CPU, for 16 rows verifying 4 tokens after 300 cached slots,
2.1 ms a layer against 0.7 ms packed. Packing is exact (the same dot products, the mask repeated per stacked head) and
plain SDPA everywhere; one token per row is packed by transformers itself, and a forward without a mask keeps its
native grouped-query path.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dflash.core.model_files.checkpoint import check_target_dir
from dflash.core.errors import DFlashError
from dflash.core.spec import TargetInfo

Loaded = tuple[Any, dict]  # from_pretrained(output_loading_info=True): the model and what loading found

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | None, device: str) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise DFlashError(f"--dtype: got {name!r}, expected one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def resolve_device(name: str | None) -> str:
    """--device as torch will take it; a device this PyTorch cannot use is one line here, not a traceback from
    the first tensor moved there."""
    if name in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "mps" if _mps_available() else "cpu"
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and not index.isdigit()):
        raise DFlashError(f"--device: got {name!r}, expected cpu, cuda[:N] or mps")
    if kind == "cuda" and not torch.cuda.is_available():
        why = "was built without CUDA" if torch.version.cuda is None else "sees no CUDA device"
        raise DFlashError(f"--device {name}: this PyTorch ({torch.__version__}) {why}; use --device cpu or auto")
    if kind == "cuda" and index and int(index) >= torch.cuda.device_count():
        raise DFlashError(f"--device {name}: expected cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    if kind == "mps" and not _mps_available():
        raise DFlashError(f"--device {name}: MPS is not available (it needs Apple silicon and a macOS build of "
                          "PyTorch); use --device cpu or auto")
    return name


@contextlib.contextmanager
def quiet_loading():
    """transformers' from_pretrained without its load report (our one-line errors say what matters) and without its
    "Loading weights" bar, which would precede every generation; a tqdm hook, so the hub's download bars stay."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    bars = hf_logging.set_tqdm_hook(lambda factory, args, kwargs: hf_logging.EmptyTqdm(*args, **kwargs))
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.set_tqdm_hook(bars)


# ("sdpa" in the name: transformers runs its SDPA checks on it, and refuses it where SDPA cannot run)
GROUPED_SDPA = "sdpa_grouped"


def sdpa_grouped(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                 row_windows: list[tuple[int, int, int]] | None = None, **kwargs):
    """query (b, heads, t, d), key / value (b, kv_heads, S, d), attention_mask (b, 1 or heads, t, S) or None;
    returns (b, t, heads, d) as transformers' attention functions do. `row_windows` (a forward's keyword, passed
    down by transformers): [(start, stop, window)], rows start..stop-1 attend over the first `window` keys only (the
    mask hides the rest from them), so rows of short sequences beside long ones read only their own part of the
    cache (backends/torch/answer_lanes.py)."""
    if row_windows is not None:
        return torch.cat([sdpa_grouped(module, query[a:b], key[a:b, :, :w], value[a:b, :, :w],
                                       None if attention_mask is None else attention_mask[a:b, ..., :w],
                                       dropout, scaling, **kwargs)[0] for a, b, w in row_windows]), None
    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, t, d = query.shape
    if (groups == 1 or t == 1 or attention_mask is None or attention_mask.dim() != 4
            or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux", "sinks"))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_heads, s = heads // groups, attention_mask.shape[-1]
    packed = query.reshape(b, kv_heads, groups * t, d)  # query head h = g * groups + j lands at rows j*t .. j*t+t-1
    if attention_mask.shape[1] == 1:
        mask = attention_mask.expand(b, groups, t, s).reshape(b, 1, groups * t, s)
    else:
        mask = attention_mask.expand(b, heads, t, s).reshape(b, kv_heads, groups * t, s)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(b, heads, t, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, sdpa_grouped)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def load_target(path, dtype: torch.dtype | Literal["auto"], device: str, trust_remote_code: bool = False,
                checked: dict | None = None):
    """A transformers causal LM from safetensors only, refused with one line when its config or weights are broken,
    when it needs custom code and --trust-remote-code was not given, or when a weight is missing or mis-shaped
    (transformers would otherwise initialise it randomly and only warn). dtype "auto": the dtype it is stored in."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = checked if checked is not None else check_target_dir(path)
    auto_map = cfg.get("auto_map")
    if auto_map and not trust_remote_code and cfg.get("model_type") not in CONFIG_MAPPING:
        code = auto_map.get("AutoModelForCausalLM", auto_map) if isinstance(auto_map, dict) else auto_map
        raise DFlashError(f"{path}/config.json: model_type {cfg.get('model_type')!r} needs custom code from the "
                          f"checkpoint (auto_map: {code}); pass --trust-remote-code to run it")
    kwargs = dict(dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True,
                  ignore_mismatched_sizes=True, output_loading_info=True)
    try:
        with quiet_loading():
            try:
                # output_loading_info=True returns (model, info); transformers types the model alone
                model, info = cast(Loaded, AutoModelForCausalLM.from_pretrained(
                    str(path), attn_implementation=GROUPED_SDPA, **kwargs))
            except ValueError as e:
                if "scaled_dot_product_attention" not in str(e):
                    raise
                # families without an SDPA path (gpt-oss: attention sinks) run transformers' eager attention
                model, info = cast(Loaded, AutoModelForCausalLM.from_pretrained(
                    str(path), attn_implementation="eager", **kwargs))
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DFlashError(f"{path}: cannot load the target model ({first})") from None
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        name, found, want = mismatched[0]
        raise DFlashError(f"{path}: weight '{name}' has shape {list(found)}, but config.json implies {list(want)} "
                          "(a config.json of another model, or a missing field?)")
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DFlashError(f"{path}: missing weight '{missing[0]}'{more} in the checkpoint")
    return model.to(device).eval().requires_grad_(False)


def decoder_layers(model) -> torch.nn.ModuleList:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise DFlashError(f"{type(model).__name__}: cannot find the decoder layers to read hidden states from")
    return layers


def target_info(model) -> TargetInfo:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    return TargetInfo(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                      vocab_size=model.get_input_embeddings().weight.shape[0], model_type=cfg.model_type,
                      rope_theta=rope.get("rope_theta", getattr(cfg, "rope_theta", None)),
                      final_logit_softcapping=getattr(cfg, "final_logit_softcapping", None))


class _Recording:
    """A decoder layer's forward that also hands its output to a LayerCapture (a pass-through once that is removed)."""

    def __init__(self, forward, capture: "LayerCapture", layer_id: int, replaced):
        self.forward, self.capture, self.layer_id = forward, capture, layer_id
        self.replaced = replaced  # the layer's instance forward it stands in for (None: the class's own)

    def __call__(self, *args, **kwargs):
        output = self.forward(*args, **kwargs)
        if self.capture.live:
            self.capture.outputs[self.layer_id] = output[0] if isinstance(output, tuple) else output
        return output


class LayerCapture:
    """The outputs of this model instance's decoder layers `layer_ids` (HF layer id i = hidden_states[i + 1], the
    output of decoder layer i), kept for the forward in flight only. Each of those layers' forward is wrapped on the
    instance rather than hooked: a forward hook sends every call of the layer through nn.Module's slow path, ~1% of a
    small target's decoding step, which a cycle that does not draft would pay over a plain step."""

    def __init__(self, model, layer_ids: list[int]):
        self.layer_ids = list(layer_ids)
        self.outputs: dict[int, torch.Tensor] = {}
        self.live = True
        self.wrapped: list[tuple[torch.nn.Module, _Recording]] = []
        layers = decoder_layers(model)
        for i in self.layer_ids:
            layer = layers[i]
            recording = _Recording(layer.forward, self, i, layer.__dict__.get("forward"))
            layer.forward = recording
            self.wrapped.append((layer, recording))

    def pop(self) -> torch.Tensor:
        """Concatenated features (b, T, K*H) of the last forward."""
        feats = torch.cat([self.outputs[i] for i in self.layer_ids], dim=-1)
        self.outputs.clear()
        return feats

    def remove(self) -> None:
        """Stop recording and unwrap the layers (a layer wrapped again since, by another capture, keeps this one's
        wrapper as a pass-through until that capture is removed too)."""
        self.live = False
        for layer, recording in self.wrapped:
            if layer.__dict__.get("forward") is not recording:
                continue
            replaced = recording.replaced
            while isinstance(replaced, _Recording) and not replaced.capture.live:
                replaced = replaced.replaced  # (a capture removed while this one was wrapped over it)
            if replaced is None:
                del layer.forward
            else:
                layer.forward = replaced
        self.wrapped = []
