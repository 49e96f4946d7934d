"""Bad inputs as a user meets them, across generate, chat, train, data and convert: every case exits non-zero, its
last stderr line is ONE line "error: ..." naming the file, field or flag and what was expected, there is no
traceback without --debug, and nothing is left behind (no output directory or file, no *.tmp).

CASES is the matrix; docs/reliability.md lists it with the real messages. Regenerate that file with
    DFLASH_RELIABILITY_DOC=docs/reliability.md python -m pytest -q tests/test_bad_inputs.py
Cases marked `sub` run as a real subprocess (`python -m dflash.X ...`); the others call main(argv) through
dflash.cli.run in-process (what `python -m` does, minus ~5 s of interpreter and torch start-up each).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflash import cli

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
           HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONPATH=str(ROOT))
G = ["--model", "{T}", "--max-new-tokens", "2"]  # generate / chat against the tiny target
TRAIN = ["--model", "{T}", "--data", "{B}/train.jsonl", "--out", "{W}/run", "--num-layers", "1", "--max-steps", "1",
         "--num-anchors", "4", "--quiet", "--no-progress", "--plot", "false", "--device", "cpu"]
REGEN = ["regenerate", "--model", "{T}", "--input", "{B}/prompts.jsonl", "--output", "{W}/gen/answers.jsonl",
         "--no-progress", "--device", "cpu", "--max-new-tokens", "2"]
FEATS = ["cache-features", "--model", "{T}", "--data", "{B}/train.jsonl", "--out", "{W}/feats", "--no-progress",
         "--device", "cpu"]


@dataclass
class Case:
    id: str
    cli: str  # generate | chat | train | data | convert | bench
    what: str  # the bad input, in words (docs/reliability.md)
    argv: list  # placeholders: {T} target, {D} drafter, {B} bad fixtures, {W} this case's empty work dir, {F} a file
    expect: tuple  # substrings of the error line (placeholders allowed)
    sub: bool = False  # a real subprocess
    stdin: str = ""
    block: tuple = ()  # packages made unimportable (sys.modules[name] = None) in the subprocess
    prepare: str | None = None  # a setup in the work dir (see prepare())


CASES = [
    # ---- directories and config.json ---------------------------------------------------------------------------------
    Case("model-missing-dir", "generate", "--model names no directory", ["--model", "{B}/nope", "--prompt", "x"],
         ("--model", "neither an existing directory nor a hub id")),
    Case("model-empty-dir", "generate", "--model is an empty directory", ["--model", "{B}/empty", "--prompt", "x"],
         ("--model", "empty directory")),
    Case("draft-missing-dir", "chat", "--draft names no directory", [*G, "--draft", "{B}/nope"],
         ("--draft", "neither an existing directory"), stdin="hi\n"),
    Case("draft-empty-dir", "generate", "--draft is an empty directory", [*G, "--draft", "{B}/empty", "--prompt", "x"],
         ("--draft", "empty directory")),
    Case("draft-config-missing", "convert", "drafter without config.json",
         ["check", "--model", "{T}", "--draft", "{B}/draft_noconfig"], ("draft_noconfig/config.json", "missing"),
         sub=True),
    Case("draft-config-not-json", "generate", "drafter config.json is not JSON",
         [*G, "--draft", "{B}/draft_notjson", "--prompt", "x"], ("draft_notjson/config.json", "not valid JSON"),
         sub=True),
    Case("draft-config-no-field", "generate", "drafter config.json lacks hidden_size",
         [*G, "--draft", "{B}/draft_nofield", "--prompt", "x"],
         ("draft_nofield/config.json", "missing required field 'hidden_size'")),
    Case("target-config-missing", "generate", "target without config.json",
         ["--model", "{B}/target_noconfig", "--draft", "{D}", "--prompt", "x"],
         ("target_noconfig/config.json", "missing")),
    Case("target-config-not-json", "generate", "target config.json is not JSON",
         ["--model", "{B}/target_notjson", "--draft", "{D}", "--prompt", "x"],
         ("target_notjson/config.json", "not valid JSON")),
    Case("target-config-no-field", "generate", "target config.json lacks hidden_size (weights say 64)",
         ["--model", "{B}/target_nofield", "--draft", "{D}", "--prompt", "x"],
         ("target_nofield", "has shape [520, 64], but config.json implies [520, 4096]")),
    Case("target-config-no-field-check", "convert", "convert check: target config.json lacks hidden_size",
         ["check", "--model", "{B}/target_nofield", "--draft", "{D}"],
         ("target_nofield/config.json", "missing integer field 'hidden_size'")),
    # ---- the pair ----------------------------------------------------------------------------------------------------
    Case("target-as-draft", "generate", "a target directory passed as --draft", [*G, "--draft", "{T}", "--prompt", "x"],
         ("config.json", "architectures", "DFlashDraftModel", "target model rather than a DFlash drafter")),
    Case("target-as-draft-check", "convert", "convert check: a target directory as --draft",
         ["check", "--model", "{T}", "--draft", "{T}"], ("DFlashDraftModel",)),
    Case("draft-hidden-size", "generate", "drafter hidden_size 32, target 64",
         [*G, "--draft", "{B}/draft_hidden", "--prompt", "x"], ("draft_hidden", "hidden_size 32 does not match", "64")),
    Case("draft-vocab", "chat", "drafter vocab_size 600, target embedding 520 rows", [*G, "--draft", "{B}/draft_vocab"],
         ("draft_vocab", "vocab_size 600 does not match", "520 rows"), stdin="hi\n"),
    Case("draft-num-target-layers", "generate", "drafter num_target_layers 6, target has 4",
         [*G, "--draft", "{B}/draft_ntl", "--prompt", "x"], ("draft_ntl", "num_target_layers 6 does not match")),
    Case("draft-layer-id-range", "generate", "target_layer_ids [1, 9] for a 4-layer target",
         [*G, "--draft", "{B}/draft_layerid", "--prompt", "x"],
         ("draft_layerid", "target_layer_ids [9] out of range", "expected 0..3")),
    Case("draft-mask-token", "generate", "mask_token_id 520 outside a 520-row embedding table",
         [*G, "--draft", "{B}/draft_mask", "--prompt", "x"], ("draft_mask", "mask_token_id 520", "expected 0..519")),
    Case("draft-mask-token-check", "convert", "convert check: mask_token_id outside the embedding table",
         ["check", "--model", "{T}", "--draft", "{B}/draft_mask"], ("mask_token_id 520",)),
    # ---- weights -----------------------------------------------------------------------------------------------------
    Case("draft-truncated", "generate", "drafter model.safetensors cut in half",
         [*G, "--draft", "{B}/draft_trunc", "--prompt", "x"], ("draft_trunc/model.safetensors", "truncated")),
    Case("draft-truncated-dtype", "convert", "convert dtype of a truncated drafter",
         ["dtype", "--draft", "{B}/draft_trunc", "--out", "{W}/out", "--dtype", "bfloat16"],
         ("draft_trunc/model.safetensors", "truncated"), sub=True),
    Case("draft-corrupted", "generate", "drafter safetensors header overwritten",
         [*G, "--draft", "{B}/draft_corrupt", "--prompt", "x"], ("draft_corrupt/model.safetensors", "corrupted")),
    Case("target-truncated", "generate", "target model.safetensors cut in half",
         ["--model", "{B}/target_trunc", "--draft", "{D}", "--prompt", "x"],
         ("target_trunc/model.safetensors", "truncated")),
    Case("target-missing-weight", "generate", "target checkpoint lacks one layer weight",
         ["--model", "{B}/target_missingw", "--draft", "{D}", "--prompt", "x"],
         ("target_missingw", "missing weight 'model.layers.2.mlp.up_proj.weight'")),
    Case("draft-missing-weight", "generate", "drafter lacks layers.1.mlp.up_proj.weight",
         [*G, "--draft", "{B}/draft_missingw", "--prompt", "x"], ("missing weight 'layers.1.mlp.up_proj.weight'",)),
    Case("draft-unexpected-weight", "generate", "drafter has an extra tensor",
         [*G, "--draft", "{B}/draft_extraw", "--prompt", "x"], ("unexpected weight 'layers.0.extra.weight'",)),
    Case("draft-misshaped-weight", "generate", "drafter fc.weight is [3, 3]",
         [*G, "--draft", "{B}/draft_shapew", "--prompt", "x"], ("'fc.weight' has shape [3, 3], expected [64, 128]",)),
    Case("draft-key-prefix", "generate", "drafter names carry a trainer's 'model.' prefix",
         [*G, "--draft", "{B}/draft_prefix", "--prompt", "x"], ("prefix 'model.'", "strip-prefix")),
    Case("draft-pickle-only", "generate", "drafter with only pytorch_model.bin",
         [*G, "--draft", "{B}/draft_bin", "--prompt", "x"], ("draft_bin", "safetensors only")),
    # ---- tokenizer and prompt ----------------------------------------------------------------------------------------
    Case("target-pickle-only", "generate", "target with only pytorch_model.bin",
         ["--model", "{B}/target_bin", "--draft", "{D}", "--prompt", "x"], ("target_bin", "safetensors only")),
    Case("tokenizer-missing", "generate", "target without tokenizer files",
         ["--model", "{B}/target_notok", "--draft", "{D}", "--prompt", "x"], ("target_notok", "no tokenizer files")),
    Case("tokenizer-other-vocab", "generate", "tokenizer of 612 tokens for a 520-row target",
         ["--model", "{B}/target_bigtok", "--draft", "{D}", "--prompt", "x"],
         ("target_bigtok", "tokenizer has 612 tokens", "520 rows")),
    Case("prompt-empty", "generate", "--prompt ''", [*G, "--draft", "{D}", "--prompt", ""], ("--prompt", "empty")),
    Case("prompt-empty-stdin", "chat", "nothing piped to chat", [*G, "--draft", "{D}"], ("stdin", "empty prompt"),
         sub=True),
    Case("prompt-too-long", "generate", "a 34-token prompt for a 16-position target",
         ["--model", "{B}/target_ctx16", "--draft", "{D}", "--prompt-ids", ",".join(["5"] * 34)],
         ("prompt", "34 tokens", "max_position_embeddings 16"), sub=True),
    Case("prompt-ids-vocab", "generate", "--prompt-ids beyond the vocabulary",
         [*G, "--draft", "{D}", "--prompt-ids", "1,99999"], ("--prompt-ids", "99999", "0..519")),
    # ---- flags -------------------------------------------------------------------------------------------------------
    Case("block-size-1", "generate", "--block-size 1", [*G, "--draft", "{D}", "--prompt", "x", "--block-size", "1"],
         ("--block-size", "got 1", "expected 2..16")),
    Case("block-size-above-trained", "generate", "--block-size 8 for a drafter trained at 4",
         [*G, "--draft", "{B}/draft_block4", "--prompt", "x", "--block-size", "8"],
         ("--block-size", "got 8", "expected 2..4")),
    Case("temperature-negative", "generate", "--temperature -1",
         [*G, "--draft", "{D}", "--prompt", "x", "--temperature", "-1"], ("--temperature", "-1"), sub=True),
    Case("top-p-nan", "generate", "--top-p nan", [*G, "--draft", "{D}", "--prompt", "x", "--top-p", "nan"],
         ("--top-p", "nan")),
    Case("min-p-nan", "chat", "--min-p nan", [*G, "--draft", "{D}", "--min-p", "nan"], ("--min-p", "nan"),
         stdin="hi\n"),
    Case("top-k-negative", "generate", "--top-k -3", [*G, "--draft", "{D}", "--prompt", "x", "--top-k", "-3"],
         ("--top-k", "-3")),
    Case("repetition-penalty-negative", "generate", "--repetition-penalty -1",
         [*G, "--draft", "{D}", "--prompt", "x", "--repetition-penalty", "-1"], ("--repetition-penalty",)),
    Case("max-context-1", "chat", "--max-context 1", [*G, "--draft", "{D}", "--max-context", "1"],
         ("--max-context", "expected >= 2"), stdin="hi\n"),
    Case("backend-unknown", "generate", "--backend jax", [*G, "--draft", "{D}", "--prompt", "x", "--backend", "jax"],
         ("--backend", "'jax'", "auto, torch, mlx"), sub=True),
    Case("backend-mlx-missing", "generate", "--backend mlx where mlx is not installed",
         [*G, "--draft", "{D}", "--prompt", "x", "--backend", "mlx"],
         ("--backend mlx", "'mlx' package is not installed"),
         sub=True, block=("mlx",)),
    Case("backend-torch-missing", "chat", "--backend torch where torch is not installed",
         [*G, "--draft", "{D}", "--backend", "torch"], ("--backend torch", "'torch' package is not installed"),
         sub=True, stdin="hi\n", block=("torch",)),
    Case("backend-auto-none", "generate", "--backend auto where neither torch nor mlx is installed",
         [*G, "--draft", "{D}", "--prompt", "x"], ("--backend auto", "neither PyTorch nor MLX is installed"),
         sub=True, block=("torch", "mlx")),
    Case("device-cuda-absent", "generate", "--device cuda:99 (no such CUDA device)",
         [*G, "--draft", "{D}", "--prompt", "x", "--backend", "torch", "--device", "cuda:99"],
         ("--device cuda:99",)),
    Case("data-torch-missing", "data", "regenerate where torch is not installed", REGEN,
         ("python -m dflash.data regenerate", "needs the 'torch' package"), sub=True, block=("torch",)),
    Case("bench-methods-torch-missing", "bench", "--methods dflash_b16 where torch is not installed",
         ["--methods", "dflash_b16", "--prompts", "reference", "--out", "{W}/out", "--no-progress"],
         ("--methods", "dflash_b16", "'torch' package, which is not installed"), sub=True, block=("torch",)),
    Case("cost-model-too-big", "bench", "cost-model at a shape whose weights exceed the free memory",
         ["cost-model", "--target-config", "{B}/huge_config.json", "--device", "cpu"],
         ("--target-config", "the weights of a 200-layer target", "GiB free")),
    Case("cost-model-too-big-mlx", "bench", "cost-model on MLX at a shape whose checkpoint exceeds the free memory",
         ["cost-model", "--backend", "mlx", "--target-config", "{B}/huge_config.json"],
         ("--target-config", "in float32 (written with PyTorch", "GiB free")),
    # ---- hub ids (validated before any network use) ------------------------------------------------------------------
    Case("hub-id-dotdot", "generate", "--model ../../etc (no such directory here)",
         ["--model", "../../etc", "--draft", "{D}", "--prompt", "x"],
         ("--model", "'../../etc'", "hub id like 'org/name'"),
         sub=True),
    Case("hub-id-three-parts", "generate", "--draft a/b/c", [*G, "--draft", "a/b/c", "--prompt", "x"],
         ("--draft", "'a/b/c'", "hub id like 'org/name'")),
    Case("hub-id-space", "convert", "convert check --model 'org/na me'",
         ["check", "--model", "org/na me", "--draft", "{D}"], ("--model", "'org/na me'")),
    # ---- safety ------------------------------------------------------------------------------------------------------
    Case("remote-code", "generate", "target whose auto_map needs custom code, no --trust-remote-code",
         ["--model", "{B}/target_remote", "--draft", "{D}", "--prompt", "x"],
         ("target_remote/config.json", "custom code", "--trust-remote-code")),
    Case("remote-code-regenerate", "data", "regenerate with a custom-code target",
         ["regenerate", "--model", "{B}/target_remote", "--input", "{B}/prompts.jsonl", "--output",
          "{W}/gen/answers.jsonl", "--no-progress", "--device", "cpu"], ("--trust-remote-code",)),
    Case("resume-pickled-object", "train", "resume checkpoint that pickles os.system", TRAIN,
         ("model.pt", "not a weights-only checkpoint", "posix.system"), prepare="evil_checkpoint"),
    Case("init-from-pickle-only", "train", "--init-from a drafter with only pytorch_model.bin",
         [*TRAIN, "--init-from", "{B}/draft_bin"], ("draft_bin", "safetensors only")),
    # ---- training data -----------------------------------------------------------------------------------------------
    Case("train-data-missing", "train", "--data names no file",
         [*TRAIN[:3], "{B}/nope.jsonl", *TRAIN[4:]], ("nope.jsonl", "does not exist")),
    Case("train-data-not-json", "train", "training JSONL whose line 2 is not JSON",
         [*TRAIN[:3], "{B}/bad_rows.jsonl", *TRAIN[4:]], ("bad_rows.jsonl:2", "not valid JSON")),
    Case("train-data-bad-field", "train", "training row whose 'messages' is a string",
         [*TRAIN[:3], "{B}/bad_messages.jsonl", *TRAIN[4:]],
         ("bad_messages.jsonl:2", "'messages' must be a list")),
    Case("train-data-no-answer", "train", "chat rows with no assistant turn",
         [*TRAIN[:3], "{B}/prompts.jsonl", *TRAIN[4:]], ("prompts.jsonl:1", "no assistant turn", "regenerate")),
    Case("train-block-size-1", "train", "train --block-size 1", [*TRAIN, "--block-size", "1"],
         ("block_size", "must be >= 2")),
    Case("train-out-under-file", "train", "--out below a regular file", [*TRAIN[:5], "{F}/run", *TRAIN[6:]],
         ("--out", "{F}", "is a file"), sub=True),
    Case("regenerate-malformed-row", "data", "regenerate input whose line 2 is not JSON",
         [*REGEN[:3], "--input", "{B}/bad_rows.jsonl", *REGEN[5:]], ("bad_rows.jsonl:2", "not valid JSON"), sub=True),
    Case("regenerate-output-under-file", "data", "regenerate --output below a regular file",
         [*REGEN[:5], "--output", "{F}/answers.jsonl", *REGEN[7:]], ("--output", "{F}/answers.jsonl", "is a file")),
    Case("regenerate-temperature-nan", "data", "regenerate --temperature nan", [*REGEN, "--temperature", "nan"],
         ("--temperature", "nan")),
    Case("regenerate-model-empty", "data", "regenerate --model an empty directory",
         [REGEN[0], "--model", "{B}/empty", *REGEN[3:]], ("--model", "empty directory")),
    Case("features-out-under-file", "data", "cache-features --out below a regular file",
         [*FEATS[:5], "--out", "{F}/feats", *FEATS[7:]], ("--out", "{F}", "is a file")),
    Case("features-layer-range", "data", "cache-features --target-layer-ids 1,99",
         [*FEATS, "--target-layer-ids", "1,99"],
         ("--target-layer-ids", "[99] out of range")),
    Case("features-top-k-negative", "data", "cache-features --top-k -1", [*FEATS, "--top-k", "-1"],
         ("--top-k", "got -1", "expected 0")),
    # ---- convert -----------------------------------------------------------------------------------------------------
    Case("convert-out-under-file", "convert", "convert dtype --out below a regular file",
         ["dtype", "--draft", "{D}", "--out", "{F}/out", "--dtype", "float16"], ("--out", "{F}", "is a file"),
         sub=True),
    Case("convert-out-not-empty", "convert", "convert dtype --out an existing non-empty directory",
         ["dtype", "--draft", "{D}", "--out", "{W}/out", "--dtype", "float16"], ("--out", "already exists"),
         prepare="existing_out"),
    Case("convert-nothing-to-strip", "convert", "strip-prefix on canonical names",
         ["strip-prefix", "--draft", "{D}", "--out", "{W}/out"], ("model.safetensors", "nothing to strip")),
    Case("convert-strip-then-invalid", "convert", "strip-prefix whose result would still be mis-shaped",
         ["strip-prefix", "--draft", "{B}/draft_prefix_shapew", "--out", "{W}/out"],
         ("draft_prefix_shapew", "'fc.weight' has shape [3, 3]")),
    Case("convert-quantize-bits", "convert", "quantize --bits 7", ["quantize", "--draft", "{D}", "--out", "{W}/out",
                                                                  "--bits", "7"], ("--bits", "got 7")),
    Case("convert-target-truncated", "convert", "target-to-mlx of a truncated target",
         ["target-to-mlx", "--model", "{B}/target_trunc", "--out", "{W}/out"], ("target_trunc/model.safetensors",)),
    Case("convert-dtype-pickle-only", "convert", "convert dtype of a pickle-only drafter",
         ["dtype", "--draft", "{B}/draft_bin", "--out", "{W}/out", "--dtype", "float16"], ("safetensors only",)),
]


# ---- fixtures --------------------------------------------------------------------------------------------------------
class Evil:
    """Pickles to os.system: a checkpoint holding it runs a command when unpickled without weights_only."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def bad(tmp_path_factory, tiny_target_dir, random_draft_dir):
    """Every broken checkpoint and data file of the matrix, each a copy of the tiny pair with one thing wrong."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    T, D = Path(tiny_target_dir), Path(random_draft_dir)
    B = tmp_path_factory.mktemp("bad")
    (B / "empty").mkdir()

    def edit_json(path, fn):
        cfg = json.loads(path.read_text())
        fn(cfg)
        path.write_text(json.dumps(cfg))

    def copy(src, name, cfg=None, weights=None, drop=(), truncate=False):
        d = B / name
        shutil.copytree(src, d)
        if cfg:
            edit_json(d / "config.json", cfg)
        if weights:
            state = load_file(d / "model.safetensors")
            weights(state)
            save_file(state, d / "model.safetensors", metadata={"format": "pt"})
        if truncate:
            data = (d / "model.safetensors").read_bytes()
            (d / "model.safetensors").write_bytes(data[: len(data) // 2])
        for f in drop:
            (d / f).unlink()
        return d

    copy(D, "draft_noconfig", drop=["config.json"])
    (copy(D, "draft_notjson") / "config.json").write_text("{not json")
    copy(D, "draft_nofield", cfg=lambda c: c.pop("hidden_size"))
    copy(D, "draft_hidden", cfg=lambda c: c.update(hidden_size=32, head_dim=16))
    copy(D, "draft_vocab", cfg=lambda c: c.update(vocab_size=600))
    copy(D, "draft_ntl", cfg=lambda c: c.update(num_target_layers=6))
    copy(D, "draft_layerid", cfg=lambda c: (c.pop("num_target_layers"),
                                            c["dflash_config"].update(target_layer_ids=[1, 9])))
    copy(D, "draft_mask", cfg=lambda c: c["dflash_config"].update(mask_token_id=520))
    copy(D, "draft_block4", cfg=lambda c: (c.update(block_size=4), c["dflash_config"].update(block_size=4)))
    copy(D, "draft_trunc", truncate=True)
    d = copy(D, "draft_corrupt")
    data = bytearray((d / "model.safetensors").read_bytes())
    data[8:40] = b"\x00\xff" * 16
    (d / "model.safetensors").write_bytes(bytes(data))
    copy(D, "draft_missingw", weights=lambda s: s.pop("layers.1.mlp.up_proj.weight"))
    copy(D, "draft_extraw", weights=lambda s: s.update({"layers.0.extra.weight": torch.zeros(2)}))
    copy(D, "draft_shapew", weights=lambda s: s.update({"fc.weight": torch.zeros(3, 3)}))
    copy(D, "draft_prefix", weights=lambda s: [s.__setitem__("model." + k, s.pop(k)) for k in list(s)])
    copy(D, "draft_prefix_shapew", weights=lambda s: (s.update({"fc.weight": torch.zeros(3, 3)}),
                                                       [s.__setitem__("model." + k, s.pop(k)) for k in list(s)]))
    d = copy(D, "draft_bin", drop=["model.safetensors"])
    torch.save(load_file(D / "model.safetensors"), d / "pytorch_model.bin")

    d = copy(T, "target_bin", drop=["model.safetensors"])
    torch.save(load_file(T / "model.safetensors"), d / "pytorch_model.bin")
    copy(T, "target_noconfig", drop=["config.json"])
    (copy(T, "target_notjson") / "config.json").write_text('{"model_type": "qwen3",')
    copy(T, "target_nofield", cfg=lambda c: c.pop("hidden_size"))
    copy(T, "target_ctx16", cfg=lambda c: c.update(max_position_embeddings=16))
    copy(T, "target_trunc", truncate=True)
    copy(T, "target_missingw", weights=lambda s: s.pop("model.layers.2.mlp.up_proj.weight"))
    copy(T, "target_notok", drop=[f.name for f in T.iterdir() if f.name.startswith(("tokenizer", "chat_template"))])
    t = copy(T, "target_remote", cfg=lambda c: c.update(
        model_type="evil_lm", architectures=["EvilForCausalLM"],
        auto_map={"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}))
    (t / "modeling_evil.py").write_text(f"open({str(B / 'REMOTE_CODE_RAN')!r}, 'w').write('ran')\n"
                                        "from transformers import Qwen3Config as EvilConfig\n"
                                        "from transformers import Qwen3ForCausalLM as EvilForCausalLM\n")
    tok = AutoTokenizer.from_pretrained(str(T))
    tok.add_tokens([f"<extra_{i}>" for i in range(100)])
    tok.save_pretrained(str(copy(T, "target_bigtok")))

    huge = dict(json.loads((T / "config.json").read_text()), hidden_size=16384, intermediate_size=65536,
                num_hidden_layers=200, num_attention_heads=128, num_key_value_heads=8, head_dim=128, layer_types=None)
    (B / "huge_config.json").write_text(json.dumps(huge))  # ~1 trillion parameters

    rows = [{"input_ids": list(range(5, 25)), "loss_mask": [0] * 8 + [1] * 12} for _ in range(4)]
    (B / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (B / "bad_rows.jsonl").write_text(json.dumps(dict(rows[0], prompt="def f(x):")) + "\n{not json\n")
    (B / "bad_messages.jsonl").write_text(json.dumps(rows[0]) + "\n" + '{"messages": "hello"}\n')
    (B / "prompts.jsonl").write_text('{"prompt": "def f(x):"}\n{"prompt": "import os"}\n')
    return {"T": str(T), "D": str(D), "B": str(B)}


def prepare(name: str | None, work: Path) -> None:
    if name == "existing_out":
        (work / "out").mkdir()
        (work / "out" / "keep.txt").write_text("mine")
    elif name == "evil_checkpoint":
        import torch

        step = work / "run" / "checkpoints" / "step_00000001"
        step.mkdir(parents=True)
        torch.save({"fc.weight": torch.zeros(2), "hook": Evil(work / "PWNED")}, step / "model.pt")
        torch.save({}, step / "optimizer.pt")
        torch.save({"step": 1, "world": 1}, step / "trainer.pt")
        (step / "DONE").write_text("ok\n")


def tree(root: Path) -> dict:
    """Every path under root with its size (directories: -1)."""
    return {str(p.relative_to(root)): (-1 if p.is_dir() else p.stat().st_size) for p in sorted(root.rglob("*"))}


def run_case(case: Case, paths: dict, capsys, debug: bool = False):
    argv = [a.format(**paths) for a in case.argv] + (["--debug"] if debug else [])
    if case.sub or debug:
        prelude = "".join(f"sys.modules[{m!r}] = None; " for m in case.block)
        cmd = [sys.executable, "-c", f"import sys, runpy; {prelude}"
               f"runpy.run_module('dflash.{case.cli}', run_name='__main__', alter_sys=True)", *argv]
        p = subprocess.run(cmd, input=case.stdin, capture_output=True, text=True, env=ENV, cwd=paths["W"],
                           timeout=300)
        return p.returncode, p.stdout, p.stderr
    module = importlib.import_module(f"dflash.{case.cli}")
    stdin, cwd = sys.stdin, os.getcwd()
    sys.stdin = io.StringIO(case.stdin)
    os.chdir(paths["W"])
    try:
        code = cli.run(module.main, argv)
    finally:
        sys.stdin = stdin
        os.chdir(cwd)
    out, err = capsys.readouterr()
    return code, out, err


MESSAGES: dict[str, str] = {}  # case id -> the error line, paths made symbolic (docs/reliability.md)


@pytest.fixture
def no_network(monkeypatch):
    """No case may reach the hub: a valid-looking id would only ever be looked up in the (empty) offline cache."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError(f"snapshot_download called with {args} {kwargs}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, bad, tmp_path, capsys, no_network):
    work = tmp_path / "work"
    work.mkdir()
    (work / "a_file").write_text("a regular file: nothing can be created below it\n")
    prepare(case.prepare, work)
    paths = dict(bad, W=str(work), F=str(work / "a_file"))
    before = {k: tree(Path(paths[k])) for k in ("T", "D", "B", "W")}

    code, out, err = run_case(case, paths, capsys)

    lines = err.strip().splitlines()
    assert code not in (0, None), f"exit {code}; stderr:\n{err}"
    assert lines, "no error message"
    last = lines[-1]
    assert "Traceback" not in err, err
    assert last.startswith("error: "), err
    assert sum(line.startswith("error: ") for line in lines) == 1, err
    for needle in case.expect:
        assert needle.format(**paths) in last, f"{needle!r} not in {last!r}"
    assert out == "", f"stdout: {out!r}"
    for k in ("T", "D", "B", "W"):  # nothing written, nothing half-written, no *.tmp, no code run
        assert tree(Path(paths[k])) == before[k], f"{k} changed: {sorted(set(tree(Path(paths[k]))) ^ set(before[k]))}"
    symbolic = last
    for k, name in (("B", "<bad>"), ("T", "<target>"), ("D", "<draft>"), ("W", "<work>")):
        symbolic = symbolic.replace(paths[k], name)
    MESSAGES[case.id] = symbolic


def test_matrix_size():
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)
    assert sum(c.sub for c in CASES) >= 10
    assert {c.cli for c in CASES} == {"generate", "chat", "train", "data", "convert", "bench"}


def test_debug_shows_the_traceback(bad, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    case = next(c for c in CASES if c.id == "draft-config-not-json")
    code, out, err = run_case(case, dict(bad, W=str(work), F=str(work / "a_file")), None, debug=True)
    assert code != 0 and "Traceback (most recent call last)" in err
    assert "DFlashError" in err and "not valid JSON" in err.strip().splitlines()[-1]


def test_every_torch_load_is_weights_only():
    """Grep-level: resume state, optimiser and RNG are loaded with weights_only=True everywhere."""
    calls = []
    for path in [*ROOT.glob("dflash/**/*.py"), *ROOT.glob("backends/**/*.py"), *ROOT.glob("converters/**/*.py")]:
        for m in re.finditer(r"torch\.load\(([^()]|\([^()]*\))*\)", path.read_text()):
            calls.append((path.name, m.group(0)))
    assert calls, "no torch.load found (the trainer's resume uses it)"
    assert all("weights_only=True" in c for _, c in calls), [c for c in calls if "weights_only=True" not in c[1]]


def test_reliability_doc_lists_the_matrix():
    if os.environ.get("DFLASH_RELIABILITY_DOC"):
        pytest.skip("being regenerated by this run")
    doc = ROOT / "docs" / "reliability.md"
    assert doc.is_file(), "docs/reliability.md is missing (see this module's docstring)"
    text = doc.read_text()
    missing = [c.id for c in CASES if f"`{c.id}`" not in text]
    assert not missing, f"docs/reliability.md lacks {missing}; regenerate it (see this module's docstring)"


@pytest.fixture(scope="module", autouse=True)
def write_doc():
    yield
    target = os.environ.get("DFLASH_RELIABILITY_DOC")
    if not target or len(MESSAGES) != len(CASES):
        return
    rows = []
    for c in CASES:
        how = "subprocess" if c.sub else "in-process"
        msg = MESSAGES[c.id].replace("|", "\\|")
        rows.append(f"| `{c.id}` | `{c.cli}` | {c.what} | {how} | `{msg}` |")
    # the server's section (tests/test_serve_hardening.py's matrix, written by hand) is kept as it is
    old = Path(target).read_text() if Path(target).is_file() else ""
    server = old[old.index(SERVER_SECTION):] if SERVER_SECTION in old else ""
    Path(target).write_text(DOC_HEAD + "\n".join(rows) + "\n" + DOC_TAIL + server)


DOC_HEAD = """# Reliability: bad inputs

Every command (`generate`, `chat`, `train`, `data`, `convert`, `bench`) refuses a bad input the same way: exit status 2,
ONE line on stderr, `error: <file, field or flag>: <what is wrong and what was expected>`, no traceback (pass
`--debug` for one), and nothing left behind: outputs are validated before any work and written atomically, so a
refused or failed run leaves no output directory, no half-written file and no `*.tmp`.

Checks run before anything slow: flags and sampling values, hub ids (`org/name`, never a path like `../../etc`;
nothing is fetched for an invalid id), the output location (a path below a regular file is refused before any model
is loaded), the drafter's `config.json`, the target's `config.json` and the headers of every safetensors file
(truncated or corrupted files never reach a framework). Then the pair is checked (hidden size, vocabulary,
`num_target_layers`, `target_layer_ids`, `mask_token_id`, `--block-size` within 2 .. the trained block size), and
weights are loaded strictly: a missing, unexpected or mis-shaped tensor, in the drafter or the target, is an
error, never a silent random initialisation.

Safety: weights load from safetensors only (a directory with only `pytorch_model.bin` / `*.pt` is refused), training
resume state is read with `torch.load(weights_only=True)` (a checkpoint that pickles anything but tensors is refused
and never executed), model code from a checkpoint (`auto_map`) runs only with `--trust-remote-code`, and hub ids are
validated before any network use.

The matrix below is `tests/test_bad_inputs.py` (paths shortened: `<target>`, `<draft>` the tiny pair, `<bad>` the
broken copies, `<work>` the run's directory). Regenerate with
`DFLASH_RELIABILITY_DOC=docs/reliability.md python -m pytest -q tests/test_bad_inputs.py`.

| case | command | bad input | run as | message |
|---|---|---|---|---|
"""
SERVER_SECTION = "\n## The server"
DOC_TAIL = """
One more: with `--debug` the same failure prints the full traceback (`test_debug_shows_the_traceback`).
"""
