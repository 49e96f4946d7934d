"""An autoregressive draft cut from a target and distilled on its answers: the draft that transformers' assisted
generation and mlx-lm's speculative decoding need (`python -m dflash.bench ar-draft`; the bundled pair's through
`python -m dflash.reference build-ar-draft`).

The draft is the target's first N decoder layers under the target's own embeddings, final norm and LM head: a plain
transformers model of the target's architecture with num_hidden_layers=N, so it shares the tokenizer and chat
template and loads wherever the target does. Its step costs N layers plus the LM head; with a large vocabulary the
head dominates (SmolLM2: the 49152 x 576 head weighs as much as 8 of its 30 layers), so a few more layers cost
little next to what they add to acceptance.

The cut layers were never trained to feed the head, so the draft is distilled on the target's own greedy answers,
tokenised with their template: at every answer position, cross-entropy to the target's next-token distribution
restricted to its top k tokens (KL to it up to a constant; the answer token, the target's argmax, carries most of the
mass). The target runs once over the data before training to record those top-k distributions. The embeddings and
the (tied) LM head stay frozen; the N layers and the final norm train (AdamW, warmup, cosine decay, fixed seed). The
head runs on answer positions only.

Before and after training, on held-out answers: top-1 agreement with the target, and tau(k), the tokens per
verification that greedy decoding with k drafted tokens per cycle would commit on those answers (teacher-forced:
the target's continuation is the answer itself). Everything goes to DIR/ar_draft.json.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from dflash.core.errors import DFlashError
from dflash.core.io import atomic_directory, atomic_write_text
from dflash.core.model_files.target_config import write_legacy_fields
from dflash.core.training.ar_draft_config import ARDraftConfig
from dflash.core.training.datasets import load_samples

from .target import quiet_loading

TAU_DRAFT_LENGTHS = (1, 2, 3, 4, 6, 8)


def decoder_layers(model, num_layers: int):
    """The model's decoder layers, checked: a decoder-only model with model.layers and an lm_head, and more layers
    than the `num_layers` to keep."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(model, "lm_head"):
        raise DFlashError(f"--model: {type(model).__name__} is not a decoder-only model with model.layers and "
                          "an lm_head; expected a transformers causal LM directory")
    n = len(layers)
    if not 1 <= num_layers < n:
        raise DFlashError(f"--layers: got {num_layers}, expected 1..{n - 1} (the target has {n} layers)")
    return layers


def cut(model, num_layers: int):
    """The model's first `num_layers` decoder layers under its embeddings, final norm and LM head (in place)."""
    model.model.layers = decoder_layers(model, num_layers)[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    return model


# ---- data ------------------------------------------------------------------------------------------------------------
def load_answers(paths: list[str], tokenizer, max_length: int) -> list[dict]:
    samples = []
    for path in paths:
        if not Path(path).is_file():
            raise DFlashError(f"--answers: {path} does not exist; answer prompts with the target first "
                              "(python -m dflash.data regenerate)")
        samples += load_samples(path, tokenizer, max_length=max_length)
    return samples


def batches(samples: list[dict], batch_tokens: int, rng: random.Random):
    """Endless shuffled batches of up to `batch_tokens` padded tokens (one long sample may exceed it alone)."""
    while True:
        order = rng.sample(range(len(samples)), len(samples))
        batch: list[dict] = []
        longest = 0
        for i in order:
            n = len(samples[i]["input_ids"])
            if batch and max(longest, n) * (len(batch) + 1) > batch_tokens:
                yield batch
                batch, longest = [], 0
            batch.append(samples[i])
            longest = max(longest, n)
        if batch:
            yield batch


def collate(rows: list[dict]):
    """input_ids (right-padded), attention_mask, and `answer`: position t's next token t+1 is an answer token."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros((len(rows), n), dtype=torch.long)
    attn = torch.zeros((len(rows), n), dtype=torch.long)
    answer = torch.zeros((len(rows), n), dtype=torch.bool)
    for b, r in enumerate(rows):
        m = len(r["input_ids"])
        ids[b, :m] = torch.tensor(r["input_ids"])
        attn[b, :m] = 1
        answer[b, :m] = torch.tensor(r["loss_mask"], dtype=torch.bool)
    return ids, attn, answer[:, 1:]


def answer_logits(model, ids, attn, answer):
    """Logits at the positions that predict an answer token (the LM head runs there only), and those tokens."""
    hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]
    return model.lm_head(hidden[answer]).float(), ids[:, 1:][answer]


def teacher_top_k(model, samples: list[dict], k: int, compute_dtype: str, progress: bool) -> float:
    """Record the target's top-k log-probabilities at every answer position of each sample (in place:
    sample["top_ids"], sample["top_logp"], renormalised over the k tokens). Returns how often the answer token is
    the target's argmax (1.0 for its own greedy answers, up to the precision of this pass)."""
    same = total = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=getattr(torch, compute_dtype),
                                         enabled=compute_dtype != "float32"):
        for s in tqdm(samples, desc="target top-k", dynamic_ncols=True, disable=not progress):
            logits, labels = answer_logits(model, *collate([s]))
            top = logits.float().topk(k, dim=-1)
            s["top_ids"], s["top_logp"] = top.indices, torch.log_softmax(top.values, dim=-1)
            same += int((top.indices[:, 0] == labels).sum())
            total += len(labels)
    return same / max(1, total)


def soft_targets(rows: list[dict]):
    return torch.cat([r["top_ids"] for r in rows]), torch.cat([r["top_logp"] for r in rows])


# ---- evaluation ------------------------------------------------------------------------------------------------------
def greedy_tau(hits: list[bool], k: int) -> float:
    """Tokens per cycle of greedy speculative decoding with k drafted tokens over an answer, given whether the
    draft's argmax matches it at each position. The first token comes from the prefill, not from a cycle."""
    pos, cycles = 1, 0
    while pos < len(hits):
        run = 0
        while run < k and pos + run < len(hits) and hits[pos + run]:
            run += 1
        pos += run + 1
        cycles += 1
    return (len(hits) - 1) / cycles if cycles else 0.0


def evaluate(model, samples: list[dict]) -> dict:
    if not samples:
        return {}
    model.eval()
    ce, hits_all = 0.0, []
    taus: dict[int, list[tuple[float, int]]] = {k: [] for k in TAU_DRAFT_LENGTHS}
    with torch.no_grad():
        for s in samples:
            ids, attn, answer = collate([s])
            logits, labels = answer_logits(model, ids, attn, answer)
            ce += F.cross_entropy(logits, labels, reduction="sum").item()
            hits = (logits.argmax(-1) == labels).tolist()
            hits_all += hits
            for k in TAU_DRAFT_LENGTHS:
                taus[k].append((greedy_tau(hits, k), len(hits) - 1))
    model.train()
    n = max(1, len(hits_all))
    return {"ce": round(ce / n, 4), "agreement": round(sum(hits_all) / n, 4), "answer_tokens": n,
            "tau": {k: round(sum(t * w for t, w in v) / max(1, sum(w for _, w in v)), 3) for k, v in taus.items()}}


# ---- distillation ----------------------------------------------------------------------------------------------------
def distill(model, train: list[dict], heldout: list[dict], *, steps: int, batch_tokens: int, lr: float,
            warmup: int, seed: int, max_minutes: float | None, compute_dtype: str = "bfloat16",
            progress: bool = True) -> dict:
    torch.manual_seed(seed)
    model.requires_grad_(False)
    params = list(model.model.layers.parameters()) + list(model.model.norm.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, steps - warmup))
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    before = evaluate(model, heldout)
    print(f"ar-draft: held-out before distillation: agreement {before.get('agreement')}, tau {before.get('tau')}",
          flush=True)
    model.train()
    rng, curve, t0, step = random.Random(seed), [], time.time(), 0
    source = batches(train, batch_tokens, rng)
    bar = tqdm(total=steps, desc="ar-draft", dynamic_ncols=True, disable=not progress)
    ema = None
    for step in range(steps):
        if max_minutes and time.time() - t0 > max_minutes * 60:
            print(f"ar-draft: --max-minutes {max_minutes} reached after {step} steps", flush=True)
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        rows = next(source)
        with torch.autocast("cpu", dtype=getattr(torch, compute_dtype), enabled=compute_dtype != "float32"):
            logits, labels = answer_logits(model, *collate(rows))
        top_ids, top_logp = soft_targets(rows)
        loss = -(top_logp.exp() * F.log_softmax(logits, dim=-1).gather(-1, top_ids)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        acc = (logits.argmax(-1) == labels).float().mean().item()
        bar.set_postfix(loss=f"{ema:.3f}", agree=f"{acc:.2f}")
        bar.update()
        if step % 25 == 0 or step == steps - 1:
            curve.append({"step": step, "loss": round(loss.item(), 4), "agreement": round(acc, 4),
                          "heldout_agreement": evaluate(model, heldout).get("agreement"),
                          "lr": round(lr_at(step), 7), "seconds": round(time.time() - t0, 1)})
    else:
        step = steps
    bar.close()
    train_seconds = time.time() - t0
    after = evaluate(model, heldout)
    print(f"ar-draft: held-out after {step} steps ({train_seconds:.0f} s): agreement {after.get('agreement')}, "
          f"tau {after.get('tau')}", flush=True)
    model.requires_grad_(False).eval()
    return {"steps": step, "train_seconds": round(train_seconds, 1), "before": before, "after": after,
            "curve": curve}


def build(target: Path, tokenizer, samples: list[dict], out: Path, settings: ARDraftConfig, *,
          answers: list[str], progress: bool = True) -> dict:
    """Cut `target` to its first settings.layers layers, distil them on `samples` (tokenised answers:
    input_ids, loss_mask) and write the draft, its tokenizer and DIR/ar_draft.json into `out`; returns the summary."""
    torch.set_num_threads(settings.threads)
    samples = list(samples)
    random.Random(settings.seed).shuffle(samples)
    heldout, train = samples[:settings.heldout], samples[settings.heldout:]
    if settings.steps and not train:
        raise DFlashError(f"--answers: {len(samples)} usable rows, all held out (--heldout {settings.heldout})")
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    total_layers = len(decoder_layers(model, settings.layers))  # checked before the target's pass over the data
    argmax_rate = teacher_top_k(model, train, settings.top_k, settings.compute_dtype, progress) \
        if settings.steps else None
    cut(model, settings.layers)
    params = sum(p.numel() for p in model.parameters())
    answer_tokens = sum(sum(s["loss_mask"]) for s in train)
    print(f"ar-draft: {target.name}'s first {settings.layers} of {total_layers} layers + its LM head: "
          f"{params / 1e6:.1f}M parameters; {len(train)} answers ({answer_tokens} answer tokens) to train on, "
          f"{len(heldout)} held out", flush=True)
    summary = {"target": str(target), "layers": settings.layers, "target_layers": total_layers, "params": params,
               "answers": answers, "train_rows": len(train), "train_answer_tokens": answer_tokens,
               "train_tokens": sum(len(s["input_ids"]) for s in train), "heldout_rows": len(heldout),
               "answer_token_is_target_argmax": None if argmax_rate is None else round(argmax_rate, 4),
               "config": asdict(settings)}
    summary |= distill(model, train, heldout, steps=settings.steps, batch_tokens=settings.batch_tokens,
                       lr=settings.lr, warmup=settings.warmup, seed=settings.seed, max_minutes=settings.max_minutes,
                       compute_dtype=settings.compute_dtype, progress=progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(out) as tmp:
        with quiet_loading():
            model.save_pretrained(str(tmp))
        write_legacy_fields(tmp)  # mlx-lm's own loader (mlx_lm_speculative) reads RoPE from the top level
        tokenizer.save_pretrained(str(tmp))
        atomic_write_text(tmp / "ar_draft.json", json.dumps(summary, indent=1) + "\n")
    return summary
