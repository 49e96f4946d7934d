"""The two steps of docs/sampling.md's sampling-trained drafter that no CLI does: the reference build's training
prompts alone, and answers files sampled under two templates tokenised into one training file.

    python scripts/sampling_drafter.py prompts runs/sampling_drafter
    python scripts/sampling_drafter.py merge runs/sampling_drafter/mix.jsonl \\
        chat=runs/sampling_drafter/ans_chat_t08.jsonl completion=runs/sampling_drafter/ans_compl_t10.jsonl ...

`prompts` writes regenerate_input.jsonl (the build's 1200 training prompts, ids p0.., as dflash/reference/build.py's
regeneration reads them) and completion_target/ (the bundled target under the plain-completion template the build
also answers with); `merge` tokenises each answers file with the template it was answered under and writes rows of
input_ids + loss_mask for `python -m dflash.train --data`, with the counts beside it (.stats.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash.reference import prompts as reference_prompts
from dflash.reference.build import BuildConfig, answer_samples, completion_target
from dflash.reference.corpus import source_files, split

TARGET = Path(__file__).resolve().parents[1] / "dflash" / "reference" / "assets" / "target"


def write_prompts(out: Path) -> None:
    cfg = BuildConfig()
    train_files, _ = split(source_files(limit_bytes=cfg.limit_bytes))  # (the held-out files are never read)
    prompts = reference_prompts.training_prompts(train_files, limit=cfg.train_prompts, seed=cfg.seed,
                                                 max_chars=cfg.train_prompt_max_chars)
    out.mkdir(parents=True, exist_ok=True)
    (out / "regenerate_input.jsonl").write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": p.prompt}) + "\n" for i, p in enumerate(prompts)))
    completion_target(TARGET, out / "completion_target")
    print(f"{len(prompts)} training prompts in {out / 'regenerate_input.jsonl'}")


def merge(out: Path, specs: list[str]) -> None:
    rows, stats = [], {}
    for spec in specs:
        fmt, path = spec.split("=", 1)
        if fmt not in ("chat", "completion"):
            raise SystemExit(f"merge: {spec!r}: expected chat=FILE or completion=FILE")
        template = TARGET if fmt == "chat" else out.parent / "completion_target"
        samples = answer_samples(template, Path(path))
        stats[path] = {"format": fmt, "samples": len(samples), "supervised_tokens": sum(sum(s["loss_mask"])
                                                                                        for s in samples)}
        rows += [{"id": f"{Path(path).stem}:{s['id']}", "input_ids": list(s["input_ids"]),
                  "loss_mask": [int(b) for b in s["loss_mask"]]} for s in samples]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out.with_suffix(".stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(f"{len(rows)} samples, {sum(v['supervised_tokens'] for v in stats.values())} supervised tokens in {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="step", required=True)
    sub.add_parser("prompts").add_argument("out", type=Path)
    m = sub.add_parser("merge")
    m.add_argument("out", type=Path)
    m.add_argument("answers", nargs="+", help="chat=FILE or completion=FILE")
    args = ap.parse_args()
    write_prompts(args.out) if args.step == "prompts" else merge(args.out, args.answers)


if __name__ == "__main__":
    main()
