"""A few training steps of a Qwen3-8B-shaped drafter with the default recipe of `python -m dflash.train`
(TrainConfig defaults: layers, block, anchors, KL weight, bf16 autocast on CUDA), on random target features and
random target final states: the drafter's own cost (packed forward, loss, backward, AdamW), without a target.

    python scripts/train_gpu_step.py            # Qwen3-8B shape (hidden 4096, vocab 151936), sequence 3072, CUDA
    python scripts/train_gpu_step.py --small    # tiny shape, any device (checks the script itself)

Prints one JSON line: median step seconds, sequence tokens/s, supervised block slots/s, peak CUDA memory.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

QWEN3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936, num_hidden_layers=36)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            vocab_size=512, num_hidden_layers=8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    from dflash.backends.torch.drafter import DFlashDrafter
    from dflash.backends.torch.training import block_loss_sum, layer_rules, sample_anchors
    from dflash.spec import DraftSpec, default_target_layer_ids
    from dflash.train_config import TrainConfig

    recipe = TrainConfig()
    shape = TINY if args.small else QWEN3_8B
    seq = args.seq_len or (128 if args.small else recipe.max_length)
    anchors_n = min(recipe.num_anchors, seq // 4) if args.small else recipe.num_anchors
    h, v, dev = shape["hidden_size"], shape["vocab_size"], args.device
    spec = DraftSpec(hidden_size=h, num_hidden_layers=recipe.num_layers, num_attention_heads=shape["num_attention_heads"],
                     num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
                     intermediate_size=shape["intermediate_size"], vocab_size=v,
                     num_target_layers=shape["num_hidden_layers"],
                     target_layer_ids=default_target_layer_ids(shape["num_hidden_layers"], recipe.num_layers),
                     mask_token_id=v - 1, block_size=recipe.block_size)
    torch.manual_seed(0)
    cuda = dev.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    drafter = DFlashDrafter(spec).to(dev)
    embed = torch.nn.Embedding(v, h).to(dev, dtype).requires_grad_(False)
    lm_head = torch.nn.Linear(h, v, bias=False).to(dev, dtype).requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=recipe.lr, betas=recipe.betas)
    feats = torch.randn(1, seq, h * spec.num_context_layers, device=dev, dtype=dtype)
    final = torch.randn(1, seq, h, device=dev, dtype=dtype)
    ids = torch.randint(0, v - 1, (1, seq), device=dev)
    mask = torch.ones(1, seq, dtype=torch.bool, device=dev)
    anchors, valid = sample_anchors(mask, anchors_n, torch.Generator(device=dev).manual_seed(0))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.steps + 2):
        t = time.perf_counter()
        with torch.autocast(dev.split(":")[0], dtype=torch.bfloat16, enabled=cuda):
            loss, _, w = block_loss_sum(drafter, embed, lm_head, feats, ids, mask, anchors, valid,
                                        block_size=spec.block_size, mask_token_id=v - 1, rules=layer_rules(spec),
                                        target_final=final, kl_weight=recipe.kl_weight, kl_top_k=recipe.kl_top_k)
            (loss / w).backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), recipe.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:  # the first steps compile FlexAttention
            times.append(time.perf_counter() - t)
    step = sorted(times)[len(times) // 2]
    print(json.dumps({"shape": "tiny" if args.small else "Qwen3-8B", "device": dev, "draft_layers": spec.num_hidden_layers,
                      "block_size": spec.block_size, "seq_len": seq, "anchors": anchors_n,
                      "kl_weight": recipe.kl_weight, "step_seconds": round(step, 4),
                      "sequence_tokens_per_second": round(seq / step, 1),
                      "block_slots_per_second": round(anchors_n * spec.block_size / step, 1),
                      "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                      "final_loss": round(float(loss.detach() / w), 4)}))


if __name__ == "__main__":
    main()
