"""The drafter being trained: its shape (from the target or an existing drafter), its initialisation, and the
wrapping that DDP / FSDP2 and activation checkpointing need."""

from __future__ import annotations

import torch
from torch import nn

from dflash.core.draft_vocab import count_answer_tokens, select_tokens
from dflash.core.errors import DFlashError
from dflash.core.spec import DFLASH2, DraftSpec, default_target_layer_ids

from ..drafter import DFlash2Layer, DFlashDrafter, load_drafter, with_draft_vocab
from .objective import packed_states


class PackedDrafter(nn.Module):
    """The drafter's packed training forward as one module call, so DDP / FSDP hooks see the whole step."""

    def __init__(self, drafter: DFlashDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, x, features, positions, mask):
        return packed_states(self.drafter, x, features, positions, mask)


def first_free_embedding_row(tokenizer, vocab_rows: int) -> int | None:
    n = len(tokenizer) if tokenizer is not None else None
    return n if n is not None and n < vocab_rows else None


def new_draft_spec(cfg, target_model, tokenizer) -> DraftSpec:
    from ..target import target_info

    info = target_info(target_model)
    tcfg = target_model.config.get_text_config()
    n_target = info.num_hidden_layers
    mask_id = cfg.mask_token_id
    if mask_id is None:
        mask_id = first_free_embedding_row(tokenizer, info.vocab_size)
        if mask_id is None:
            raise DFlashError(f"--mask-token-id: the target's embedding table has {info.vocab_size} rows and no unused "
                              "row past the tokenizer's vocabulary; pass --mask-token-id ID explicitly")
    if not 0 <= mask_id < info.vocab_size:
        raise DFlashError(f"--mask-token-id: {mask_id} is outside the target's embedding table "
                          f"(0..{info.vocab_size - 1})")
    layer_ids = cfg.target_layer_ids or default_target_layer_ids(n_target, cfg.num_layers)
    rope = getattr(tcfg, "rope_parameters", None) or {}
    rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default") != \
        "default" else None
    heads = tcfg.num_attention_heads
    sliding = sliding_layers(cfg)
    if cfg.arch == "dflash2":
        sliding.update(dflash2_fields(cfg))
    spec = DraftSpec(
        hidden_size=tcfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads,
        intermediate_size=tcfg.intermediate_size, vocab_size=info.vocab_size, num_target_layers=n_target,
        target_layer_ids=list(layer_ids), mask_token_id=int(mask_id), block_size=cfg.block_size,
        rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6), rope_theta=float(info.rope_theta or 10000.0),
        rope_scaling=rope_scaling, max_position_embeddings=getattr(tcfg, "max_position_embeddings", 40960),
        attention_bias=bool(getattr(tcfg, "attention_bias", False)), context_mode=cfg.context_mode, **sliding)
    spec.check("--num-layers/--block-size/--target-layer-ids/--context-mode" +
               ("/--conv-group-size/--conv-kernel-size/--selector-top-k" if spec.is_dflash2 else ""))
    spec.validate_against(info, source="new drafter")
    return spec


def dflash2_fields(cfg) -> dict:
    """DraftSpec fields of a new DFlash2 drafter, laid out as the public ones are: the convolution and the
    selector, and sliding layers (window 2048 unless --sliding-window says otherwise) that are not causal."""
    fields = dict(architecture=DFLASH2, conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
                  selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k)
    if cfg.sliding_window is None:
        fields.update(sliding_window=2048, use_sliding_window=True,
                      layer_types=["sliding_attention"] * cfg.num_layers, extra={"is_causal": False})
    return fields


def sliding_layers(cfg) -> dict:
    """DraftSpec fields for --sliding-window / --layer-types / --is-causal (a new drafter's declared attention)."""
    if cfg.sliding_window is None:
        if cfg.layer_types or cfg.is_causal is not None:
            raise DFlashError("--layer-types/--is-causal: they describe sliding layers; add --sliding-window N")
        return {}
    if cfg.sliding_window < 1:
        raise DFlashError(f"--sliding-window: got {cfg.sliding_window}, expected >= 1")
    types = list(cfg.layer_types or ["sliding_attention"] * cfg.num_layers)
    if len(types) != cfg.num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise DFlashError(f"--layer-types: expected {cfg.num_layers} of sliding_attention/full_attention, got {types}")
    causal = False if cfg.is_causal is None and cfg.arch == "dflash2" else cfg.is_causal  # DFlash2's: not causal
    extra = {} if causal is None else {"is_causal": bool(causal)}
    return dict(sliding_window=int(cfg.sliding_window), use_sliding_window=True, layer_types=types, extra=extra)


def init_drafter(spec: DraftSpec, target_model, mode: str, seed: int) -> DFlashDrafter:
    """A new drafter. Linear weights ~ N(0, target initializer_range) (the HF Qwen3 init), norms = 1. With mode
    "target", draft layer i starts as a copy of target layer L-n+i wherever names and shapes match, and the final
    norm as the target's: the last target layers already map hidden states into the space the shared LM head reads,
    which makes the first steps productive instead of spent aligning random layers to the LM head. "target-first"
    copies the first n target layers instead (they read raw token embeddings, as draft layer 0 does)."""
    from ..target import decoder_layers

    torch.manual_seed(seed)
    model = DFlashDrafter(spec)
    std = getattr(target_model.config.get_text_config(), "initializer_range", 0.02)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    if mode in ("target", "target-first"):
        layers = decoder_layers(target_model)
        offset = len(layers) - spec.num_hidden_layers if mode == "target" else 0
        with torch.no_grad():
            for i, layer in enumerate(model.layers):
                src = layers[max(offset + i, 0)].state_dict()
                for name, p in layer.state_dict().items():
                    if name in src and src[name].shape == p.shape:
                        p.copy_(src[name])
            base = target_model.get_decoder() if hasattr(target_model, "get_decoder") else target_model.model
            if hasattr(base, "norm") and base.norm.weight.shape == model.norm.weight.shape:
                model.norm.weight.copy_(base.norm.weight)
    elif mode != "random":
        raise DFlashError(f"--init-layers: got {mode!r}, expected target, target-first or random")
    if spec.is_dflash2:
        start_dflash2(model, std)
    if spec.context_mode == "input":
        # input fusion adds the normed feature to the token embeddings: start it at their scale, or (RMS 1 against
        # ~0.05 on the reference target) it drowns the anchor token and every slot's input looks the same
        with torch.no_grad():
            model.hidden_norm.weight.fill_(target_model.get_input_embeddings().weight.float().pow(2).mean().sqrt())
    return model


def start_dflash2(model: DFlashDrafter, std: float) -> None:
    """DFlash2's own parts at their start: every convolution the identity (tap 0 = 1, no dynamic part), so the
    drafter begins as the DFlash drafter its layers make; the selector's codebooks small and random."""
    with torch.no_grad():
        for layer in model.layers:
            assert isinstance(layer, DFlash2Layer)
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0
                conv.kernel_projection.weight.zero_()
        selector = model.candidate_selector
        for p in (selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight):
            nn.init.normal_(p, std=std)


def as_dflash2(drafter: DFlashDrafter, cfg, std: float) -> DFlashDrafter:
    """A DFlash2 drafter that starts as the DFlash `drafter`: its weights, identity convolutions, a new selector."""
    import dataclasses

    torch.manual_seed(cfg.seed)
    fields = dflash2_fields(dataclasses.replace(cfg, num_layers=drafter.spec.num_hidden_layers,
                                                sliding_window=drafter.spec.sliding_window))
    fields["extra"] = {**drafter.spec.extra, **fields.get("extra", {})}  # keys other tools wrote stay
    spec = dataclasses.replace(drafter.spec, **fields)
    spec.check("--arch dflash2 --init-from")
    model = DFlashDrafter(spec)
    start_dflash2(model, std)
    missing, unexpected = model.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or k.startswith("candidate_selector.") for k in missing), missing
    return model


def build_drafter(cfg, target_model, tokenizer) -> DFlashDrafter:
    """The drafter to train, in float32 on the CPU: loaded from --init-from, or new and initialised."""
    if cfg.init_from:
        from ..target import target_info

        drafter = load_drafter(cfg.init_from, dtype=torch.float32, device="cpu")
        drafter.spec.validate_against(target_info(target_model), source=str(cfg.init_from))
        if cfg.arch == "dflash" and drafter.spec.is_dflash2:
            raise DFlashError(f"--arch dflash: {cfg.init_from} is a DFlash2 drafter; drop --arch or start a new "
                              "drafter without --init-from")
        if cfg.arch == "dflash2" and not drafter.spec.is_dflash2:
            std = getattr(target_model.config.get_text_config(), "initializer_range", 0.02)
            drafter = as_dflash2(drafter, cfg, std)
        return drafter.train()
    spec = new_draft_spec(cfg, target_model, tokenizer)
    return init_drafter(spec, target_model, cfg.init_layers, cfg.seed)


def restrict_vocab(drafter: DFlashDrafter, size: int, samples: list[dict], head: torch.Tensor,
                   init_from: str | None = None) -> DFlashDrafter:
    """--draft-vocab N: the drafter with a draft vocabulary of the N tokens most frequent among the supervised
    tokens of the training samples (the target's own answers), its head the target's rows. A drafter that has one
    already keeps it (N must be its size)."""
    spec = drafter.spec
    if spec.draft_vocab_size is not None:
        if size != spec.draft_vocab_size:
            raise DFlashError(f"--draft-vocab: {init_from} has a draft vocabulary of {spec.draft_vocab_size} tokens "
                              f"already; drop --draft-vocab or pass {spec.draft_vocab_size}")
        return drafter
    ids = select_tokens(count_answer_tokens(samples), size, spec.vocab_size)
    return with_draft_vocab(drafter, ids, head.float())


def checkpoint_layers(drafter: DFlashDrafter) -> None:
    """Recompute each draft layer in backward; an instance-level forward, so the state dict keeps its names."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    for layer in drafter.layers:
        layer.forward = partial(checkpoint, type(layer).forward.__get__(layer), use_reentrant=False)


def wrap_for_parallel(drafter: DFlashDrafter, parallel: str, d, device: str) -> tuple[nn.Module, bool]:
    """(the module the step calls, whether it is FSDP-sharded). DDP replicates; FSDP2 shards per draft layer + root."""
    module = PackedDrafter(drafter)
    if d.world == 1:
        return module, False
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, device_ids=[d.local_rank] if device.startswith("cuda") else None), False
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in drafter.layers:
            fully_shard(layer)
        fully_shard(module)
        return module, True
    raise DFlashError(f"--parallel: got {parallel!r}, expected ddp or fsdp")
