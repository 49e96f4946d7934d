"""python -m dflash.bench gpu-check: the prepared GPU check, one report in JSON + Markdown.

  1. the GPU-marked tests (CUDA graphs + bf16 losslessness, FlexAttention mask == dense mask)
  2. bf16 training steps of a drafter at a real shape (Qwen3-8B, 5 layers, block 16) with the default recipe of
     python -m dflash.train: tokens/s, peak memory
  3. the cost model at Qwen3-8B and Qwen3-4B shapes, blocks 8 and 16: (T_draft + T_verify) / T_step, and the
     tree forward's T_verify(n) for budgets up to 512 nodes (what --verify auto fits its budget to)

`--small` runs the same pipeline at tiny shapes on whatever device is there (CPU here), so it stays runnable.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .. import cli
from ..core.io import atomic_write_text
from ..core.spec import DraftSpec, default_target_layer_ids
from ..core.training.train_config import TrainConfig
from .costmodel import main as cost_model_main


def run_gpu_tests() -> dict:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/"], capture_output=True, text=True)
    tail = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr.strip()[-300:]
    return {"returncode": p.returncode, "summary": tail, "seconds": time.perf_counter() - t}


def training_steps(config: dict, draft_layers: int, block_size: int, seq_len: int, anchors: int, steps: int,
                   device: str) -> dict:
    """Drafter training steps with the default recipe of `python -m dflash.train` (TrainConfig: lr, betas, clip, KL
    weight and top-k, bf16 autocast on CUDA) on random target features and final states: the drafter's own cost
    (packed forward, loss, backward, AdamW), without a target forward."""
    import torch

    from dflash.backends.torch import DFlashDrafter
    from dflash.backends.torch.training import block_loss_sum, layer_rules, sample_anchors

    recipe = TrainConfig()
    h, v = config["hidden_size"], config["vocab_size"]
    spec = DraftSpec(hidden_size=h, num_hidden_layers=draft_layers, num_attention_heads=config["num_attention_heads"],
                     num_key_value_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
                     intermediate_size=config["intermediate_size"], vocab_size=v,
                     num_target_layers=config["num_hidden_layers"],
                     target_layer_ids=default_target_layer_ids(config["num_hidden_layers"], draft_layers),
                     mask_token_id=v - 1, block_size=block_size)
    torch.manual_seed(0)
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    drafter = DFlashDrafter(spec).to(device)
    embed = torch.nn.Embedding(v, h).to(device, dtype).requires_grad_(False)
    lm_head = torch.nn.Linear(h, v, bias=False).to(device, dtype).requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=recipe.lr, betas=recipe.betas)
    feats = torch.randn(1, seq_len, h * spec.num_context_layers, device=device, dtype=dtype)
    final = torch.randn(1, seq_len, h, device=device, dtype=dtype)  # the target's last hidden states (KL term)
    ids = torch.randint(0, v - 1, (1, seq_len), device=device)
    mask = torch.ones(1, seq_len, dtype=torch.bool, device=device)
    anchor_ids, valid = sample_anchors(mask, anchors, torch.Generator(device=device).manual_seed(0))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=cuda):
            loss, _, weight = block_loss_sum(drafter, embed, lm_head, feats, ids, mask, anchor_ids, valid,
                                             block_size=block_size, mask_token_id=v - 1, rules=layer_rules(spec),
                                             target_final=final, kl_weight=recipe.kl_weight,
                                             kl_top_k=recipe.kl_top_k)
            (loss / weight).backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), recipe.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:  # the first steps compile FlexAttention
            times.append(time.perf_counter() - t)
    step = sorted(times)[len(times) // 2]
    return {"draft_layers": draft_layers, "block_size": block_size, "seq_len": seq_len, "anchors": anchors,
            "kl_weight": recipe.kl_weight, "step_seconds": step, "sequence_tokens_per_second": seq_len / step,
            "block_tokens_per_second": anchors * block_size / step,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "final_loss": float(loss.detach() / weight)}


def cost_model(shape: str, draft_layers: int, device: str, compile: bool, context: int,
               tree_budgets: list[int]) -> dict:
    out = Path("/tmp") / f"dflash-cost-{Path(shape).stem}.json"
    args = ["--target-config", shape, "--draft-layers", str(draft_layers), "--block-sizes", "8", "16",
            "--context", str(context), "--iters", "20", "--warmup", "5", "--device", device, "--json", str(out)]
    if tree_budgets and not compile:  # trees run on the dynamic cache
        args += ["--tree-budgets", *map(str, tree_budgets)]
    cost_model_main(args + (["--compile"] if compile else []))
    return json.loads(out.read_text())


def markdown(report: dict) -> str:
    lines = [f"# GPU check ({report['device_name']})", "",
             f"torch {report['torch']}, transformers {report['transformers']}, {report['when']}", "",
             f"GPU tests: `{report['gpu_tests']['summary']}`", "", "## Cost model (batch 1)", "",
             "| shape | compile | block | T_step ms | T_draft ms | T_verify ms | (T_draft+T_verify)/T_step |",
             "|---|---|---|---|---|---|---|"]
    for r in report["cost_model"]:
        for b, x in r["blocks"].items():
            lines.append(f"| {r['target']} | {r['compile']} | {b} | {r['t_step'] * 1e3:.2f} | {x['t_draft'] * 1e3:.2f} "
                         f"| {x['t_verify'] * 1e3:.2f} | {x['cycle_over_step']:.2f} |")
    trees = [r for r in report["cost_model"] if r.get("trees")]
    if trees:
        lines += ["", "## Tree verify (block 16, dynamic cache): cycle cost per budget", "",
                  "| shape | nodes | T_verify(n+1) ms | (T_draft+T_verify)/T_step |", "|---|---|---|---|"]
        for r in trees:
            for n, x in r["trees"]["budgets"].items():
                lines.append(f"| {r['target']} | {n} | {x['t_verify'] * 1e3:.2f} | {x['cycle_over_step']:.2f} |")
    t = report["training"]
    lines += ["", "## Drafter training steps (bf16 autocast, FlexAttention on CUDA)", "",
              f"{t['draft_layers']} layers, block {t['block_size']}, {t['seq_len']} tokens x {t['anchors']} anchors: "
              f"{t['step_seconds'] * 1e3:.0f} ms/step, {t['sequence_tokens_per_second']:.0f} sequence tokens/s, "
              f"peak memory {t['peak_memory_gib'] if t['peak_memory_gib'] is None else round(t['peak_memory_gib'], 1)} GiB",
              ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m dflash.bench.gpucheck", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes (runs on CPU)")
    p.add_argument("--out", default="runs/gpu_check", help="report path prefix (.json and .md are written)")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict[str, Any]
    report = {"device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    report["gpu_tests"] = {"summary": "skipped"} if args.skip_tests else run_gpu_tests()
    print("gpu tests:", report["gpu_tests"]["summary"], flush=True)
    if args.small:
        tiny = json.loads((Path(__file__).parent / "configs" / "qwen3-8b.json").read_text())
        tiny.update(hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    intermediate_size=256, vocab_size=2048)
        small_path = Path("/tmp/dflash-tiny-shape.json")
        small_path.write_text(json.dumps(tiny))
        report["training"] = training_steps(tiny, 2, 16, 256, 16, 2, device)
        shapes, context = [str(small_path)], 64
    else:
        cfg8 = json.loads((Path(__file__).parent / "configs" / "qwen3-8b.json").read_text())
        report["training"] = training_steps(cfg8, 5, 16, 3072, 512, 5, device)
        shapes, context = ["qwen3-8b", "qwen3-4b"], 1024
    print("training:", {k: v for k, v in report["training"].items()}, flush=True)
    report["cost_model"] = []
    for shape in shapes:
        for compile in ([False, True] if device == "cuda" else [False]):
            budgets = [1, 4, 8, 16] if args.small else [1, 4, 8, 15, 32, 64, 128, 256, 512]
            r = cost_model(shape, 2 if args.small else 5, device, compile, context, budgets)
            r["target"], r["compile"] = Path(shape).stem, compile
            report["cost_model"].append(r)
            if device == "cuda":
                torch.cuda.empty_cache()
    atomic_write_text(args.out + ".json", json.dumps(report, indent=2))
    atomic_write_text(args.out + ".md", markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
