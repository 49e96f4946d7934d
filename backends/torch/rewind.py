"""Exact rewinding of target caches whose layers keep bounded state instead of one K/V entry per position.

Speculative decoding feeds B positions to the target and keeps only the first k of them. A full-attention K/V cache
rewinds by slicing. Two kinds of layer need more:

- sliding-window attention (gpt-oss): the cache keeps only the last W-1 positions, so entries a rejected block pushed
  out are gone. transformers' `activate_past_recording()` keeps them until the next `crop`.
- Gated DeltaNet linear attention (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): a causal-conv window (the raw inputs of the last
  `kernel` positions) and a recurrent state S (heads x d_k x d_v) that every position updates in place. With
  `activate_past_recording()` transformers rewinds the conv window, but not S, which has no per-position history.
  transformers 5.25 keeps one on request (`recurrent_states_to_keep=N`: the forward runs its last N positions one at
  a time through the recurrent kernel, cloning S after each; `crop` restores S from that record and drops it). We ask
  for none: the verify forward stays one chunked pass, and any number of rewinds may follow it (below). Its `crop`
  then cannot rewind a linear layer (it would index the missing record), so CacheRewind crops those itself: the conv
  window as the library does, S as below.

How S is rewound, exactly: before each target forward we copy S (S0: the state after the last cached position). The
forward records, per linear layer, the raw conv input of every position (the recording conv state) and the outputs
of `in_proj_a` / `in_proj_b` (instance-level forward hooks on this model's modules). To keep the first k positions of
the forward we rebuild their q, k, v, g, beta from those recordings with the layer's own parameters and the library's
own functions (`causal_conv1d_fn`, then the same split / reshape / sigmoid / softplus as the layer's forward) and run
the library's gated-delta kernel from S0 over those k positions only. Every input of a position (its conv window, a
and b) depends only on that position and the ones before it, so this is S after exactly the accepted tokens: the
state a forward of only those k tokens would have left, with the values the verify forward itself computed (the same
standard as keeping the verify forward's K/V entries in an attention cache). The work is the recurrence over k <= B
positions (conv, l2norm and the delta rule on a (heads, d_k, d_v) state) per linear layer; no projection is re-run and
no weights are read again, so it costs a small fraction of a verify forward (see tests/test_families.py).

Any number of rewinds may follow one forward, as long as they stay inside it (commit(k) then crop(...) in the cost
model): each rewind restores the post-forward references and crops from there. Going back further than the last
forward is impossible for these layers; `rewind` then returns False and the backend starts over from an empty cache.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
import transformers

from dflash.core.errors import DFlashError

from .target import decoder_layers

_LINEAR_ATTRS = ("in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias", "head_k_dim", "head_v_dim", "key_dim",
                 "value_dim", "activation")
_KV_FIELDS = ("keys", "values", "cumulative_length")
# transformers 5.25: linear-attention cache layers record per-position recurrent states on request (module docstring)
# and count their positions (`cumulative_length_linear`; a Qwen3.5 forward takes its positions from layer 0's count)
_TRANSFORMERS_5_25 = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 25)


def bounded_layers(cache) -> bool:
    """Whether any layer of a transformers cache keeps bounded state (sliding window or linear attention)."""
    return any(getattr(layer, "is_sliding", False) or hasattr(layer, "conv_states") for layer in cache.layers)


class CacheRewind:
    """Rewinds one transformers DynamicCache of one model instance (see the module docstring)."""

    def __init__(self, model):
        self.linear: dict[int, torch.nn.Module] = {}
        self.handles = []
        self.ab: dict[int, dict[str, torch.Tensor]] = {}
        for i, layer in enumerate(decoder_layers(model)):
            mixer = getattr(layer, "linear_attn", None)
            if mixer is None:
                continue
            missing = [a for a in _LINEAR_ATTRS if not hasattr(mixer, a)]
            if missing:
                raise DFlashError(f"{type(mixer).__name__}: a linear-attention layer this backend cannot rewind "
                                  f"(no {', '.join(missing)}); speculative decoding needs an exact rollback")
            self.linear[i] = mixer
            self.ab[i] = {}
            for name in ("a", "b"):
                self.handles.append(getattr(mixer, f"in_proj_{name}").register_forward_hook(self._record(i, name)))
        self.cache: Any = None  # the DynamicCache of attach() (transformers' caches are untyped)
        self.snapshot: dict[int, torch.Tensor | None] = {}
        self.post: list[dict] | None = None
        self.length = 0  # positions of the last forward
        self.kept = 0  # of which still cached

    def _record(self, i: int, name: str):
        def hook(module, args, output):
            self.ab[i][name] = output
        return hook

    def attach(self, cache) -> None:
        unknown = [i for i, layer in enumerate(cache.layers) if hasattr(layer, "conv_states") and i not in self.linear]
        if unknown:
            raise DFlashError(f"layer {unknown[0]}: recurrent/convolutional state of a kind this backend cannot "
                              "rewind (only Gated DeltaNet linear attention is); speculative decoding needs an exact "
                              "rollback")
        if _TRANSFORMERS_5_25:
            cache.activate_past_recording(recurrent_states_to_keep=0)  # S is rewound here, not from a record
        else:
            cache.activate_past_recording()
        self.cache, self.post, self.snapshot = cache, None, {}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    # ---- around each target forward -------------------------------------------------------------------------------
    def before_forward(self) -> None:
        cache = self.cache
        if self.post is not None:
            cache.crop(0)  # drop the recorded history of the previous forward (windows back to their working size)
        for i in self.linear:
            layer = cache.layers[i]
            state = layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None
            kept = self.snapshot.get(i)
            if state is None:
                self.snapshot[i] = None
            elif kept is None or kept.shape != state.shape:
                self.snapshot[i] = state.clone()
            else:
                kept.copy_(state)

    def after_forward(self, length: int) -> None:
        self.length = self.kept = length
        self.post = [self._fields(layer) for layer in self.cache.layers]

    # ---- rewinding ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def rewind(self, n: int) -> bool:
        """Forget the last n cached positions. True when done exactly; False (nothing changed) when that reaches
        past the last forward, which bounded layers cannot do."""
        keep = self.kept - n
        if n <= 0:
            return n == 0
        if self.post is None or keep < 0 or (keep == 0 and any(s is None for s in self.snapshot.values())):
            return False
        drop = self.length - keep
        for i, (layer, fields) in enumerate(zip(self.cache.layers, self.post)):
            for name, value in fields.items():
                setattr(layer, name, dict(value) if name == "conv_states" else value)
            if i in self.linear:
                self._rewind_linear(i, self.linear[i], layer, drop, keep)
                if _TRANSFORMERS_5_25:  # (not a field restored above: it goes back by the n positions forgotten)
                    layer.cumulative_length_linear.sub_(n)
            else:
                layer.crop(-drop)  # K/V and sliding windows (library)
        self.kept = keep
        return True

    def _rewind_linear(self, i: int, mixer, layer, drop: int, keep: int) -> None:
        """Conv window and recurrent state of linear layer i after the first `keep` positions of the last forward."""
        # the recording conv state: the raw conv inputs [window before the forward ; its positions]
        x = layer.conv_states[0][..., : layer.conv_states[0].shape[-1] - drop]
        layer.conv_states[0] = x[..., -layer.conv_kernel_size[0]:]  # the window transformers' crop keeps
        state = layer.recurrent_states[0]
        s0 = self.snapshot[i]
        if keep == 0:
            state.copy_(s0)
            return
        lib = sys.modules[type(mixer).__module__]
        # the layer's forward, restricted to the kept positions: causal conv over [previous window ; kept inputs]
        qkv = lib.causal_conv1d_fn(x, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias,
                                   activation=mixer.activation)[..., -keep:].transpose(1, 2)
        q, k, v = torch.split(qkv, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
        b_, t = q.shape[:2]
        q = q.reshape(b_, t, -1, mixer.head_k_dim)
        k = k.reshape(b_, t, -1, mixer.head_k_dim)
        v = v.reshape(b_, t, -1, mixer.head_v_dim)
        a, b = self.ab[i]["a"][:, :keep], self.ab[i]["b"][:, :keep]
        beta = b.sigmoid()
        g = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)
        if keep == 1 and s0 is not None:  # the layer's own choice for a forward of `keep` positions
            kernel, extra = lib.torch_recurrent_gated_delta_rule, {}
        else:
            # transformers' reference kernel pads the positions to its chunk (64); a chunk that just covers them
            # gives the same state (the padding adds exact zeros) for a fraction of the work. Kernels that take no
            # chunk size (flash-linear-attention) never see the argument: the wrapper drops it.
            kernel, extra = lib.torch_chunk_gated_delta_rule, {"chunk_size": min(64, -(-keep // 16) * 16)}
        _, new = kernel(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                        use_qk_l2norm_in_kernel=True, **extra)
        state.copy_(new)

    @staticmethod
    def _fields(layer) -> dict:
        fields = {name: getattr(layer, name) for name in _KV_FIELDS if hasattr(layer, name)}
        if hasattr(layer, "conv_states"):
            fields["conv_states"] = dict(layer.conv_states)
        return fields
