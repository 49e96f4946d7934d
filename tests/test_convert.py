"""`python -m dflash.convert`: each subcommand, one-line errors, and no partial output when a conversion fails."""

import json
import subprocess
import sys

import pytest
torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file

from dflash import cli
from dflash.convert import main
from dflash.core.errors import DFlashError


def convert(*args):
    return cli.run(main, [str(a) for a in args])


def siblings(path):
    """What exists beside `path` (temporary directories of a failed write would show up here)."""
    return sorted(p.name for p in path.parent.iterdir())


def test_check_reports_the_pair(tiny_target_dir, random_draft_dir, capsys):
    assert convert("check", "--model", tiny_target_dir, "--draft", random_draft_dir) == 0
    out = capsys.readouterr().out
    assert "hidden size      64 = 64" in out and "mask token       519" in out and out.rstrip().endswith("compatible")
    assert convert("check", "--model", tiny_target_dir, "--draft", random_draft_dir, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compatible"] and report["draft"]["target_layer_ids"] == [1, 1]
    assert report["target"]["embedding_rows"] == 520 and report["target"]["tokenizer_size"] == 512


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", 32, "hidden_size 32 does not match"),
    ("vocab_size", 600, "vocab_size 600 does not match"),
    ("num_target_layers", 6, "num_target_layers 6 does not match"),
])
def test_check_mismatch_is_one_line_and_non_zero(tmp_path, tiny_target_dir, random_draft_dir, capsys, field, value,
                                                  message):
    cfg = json.loads((random_draft_dir / "config.json").read_text())
    cfg[field] = value
    if field == "hidden_size":
        cfg["head_dim"] = 16
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((random_draft_dir / "model.safetensors").read_bytes())
    code = convert("check", "--model", tiny_target_dir, "--draft", tmp_path)
    err = capsys.readouterr().err
    assert code != 0 and message in err and len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def transformers_5_llama(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny Llama pair whose target config.json is spelled as transformers 5 writes it (SmolLM2's layout: rope_theta
    100000 inside rope_parameters only), and the drafter made for it."""
    from dflash.backends.torch.drafter import DFlashDrafter, save_drafter
    from dflash.reference import tiny

    d = tmp_path_factory.mktemp("t5llama")
    tiny.build_target(d / "target", tiny_tokenizer_dir, family="llama", seed=0, rope_theta=100000.0)
    config = json.loads((d / "target" / "config.json").read_text())
    del config["rope_theta"]
    (d / "target" / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(tiny.draft_spec_for(d / "target", num_layers=1, block_size=8)), d / "draft")
    return d / "target", d / "draft"


def copy_target(src, dst, **config_changes):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return dst


def test_check_compares_what_each_backends_loader_reads(tmp_path, transformers_5_llama, capsys):
    """The config as transformers, dflash's MLX backend and mlx-lm's own loader read it: a transformers-5 config
    that mlx-lm reads with its own default theta is incompatible until its top-level keys are written."""
    pytest.importorskip("mlx_lm")
    from dflash.core.model_files.target_config import write_legacy_fields

    target, draft = transformers_5_llama
    assert convert("check", "--model", target, "--draft", draft) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(target / "config.json") in err
    assert "mlx-lm's own loader reads rope_theta 10000 (transformers: 100000)" in err

    fixed = copy_target(target, tmp_path / "fixed")
    assert write_legacy_fields(fixed)
    assert convert("check", "--model", fixed, "--draft", draft, "--json") == 0
    loaders = json.loads(capsys.readouterr().out)["loaders"]
    assert loaders["transformers"] == loaders["mlx"] and loaders["mlx"]["rope_theta"] == 100000.0
    assert convert("check", "--model", fixed, "--draft", draft) == 0
    assert "target config    transformers = mlx-lm: rope theta 100000 (default), head dim 16" in capsys.readouterr().out

    # a field no RoPE key explains: without tie_word_embeddings transformers' Llama unties, mlx-lm's ties
    untied = copy_target(fixed, tmp_path / "untied", tie_word_embeddings=None)
    assert convert("check", "--model", untied, "--draft", draft) == 2
    err = capsys.readouterr().err
    assert "dflash's MLX backend reads tie_word_embeddings True (transformers: False)" in err


def test_check_refuses_a_config_only_dflash_reads(tmp_path):
    """Qwen3-MoE saved by transformers 5: mlx-lm's ModelArgs require a top-level rope_theta and cannot load it at all;
    the MLX backend (given the top-level keys) reads what transformers reads."""
    pytest.importorskip("mlx_lm")
    from dflash.converters.compat import loader_readings

    config = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "norm_topk_prob": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match=r"config\.json: mlx-lm cannot read it \(.*'rope_theta'\) as the file "
                                          r"stands \(mlx-lm's own loader\)"):
        loader_readings(tmp_path, [])
    config["rope_theta"] = 1000000.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    notes = []
    loaders = loader_readings(tmp_path, notes)
    assert notes == [] and loaders["mlx"] == loaders["transformers"]
    assert loaders["mlx"]["rope_theta"] == 1000000.0 and loaders["mlx"]["num_key_value_heads"] == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dtype_matches_torch_rounding(tmp_path, random_draft_dir, dtype):
    out = tmp_path / dtype
    assert convert("dtype", "--draft", random_draft_dir, "--out", out, "--dtype", dtype) == 0
    ref = load_file(random_draft_dir / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].dtype == getattr(torch, dtype) and torch.equal(got[k], ref[k].to(getattr(torch, dtype))), k
    assert json.loads((out / "config.json").read_text())["dflash_config"]["mask_token_id"] == 519
    from dflash.backends.torch.drafter import load_drafter

    load_drafter(out)  # canonical: the strict loader accepts it


def test_strip_prefix_restores_canonical_names(tmp_path, random_draft_dir):
    from dflash.backends.torch.drafter import load_drafter

    src = tmp_path / "wrapped"
    src.mkdir()
    state = load_file(random_draft_dir / "model.safetensors")
    save_file({f"_orig_mod.model.{k}": v for k, v in state.items()}, src / "model.safetensors")
    (src / "config.json").write_text((random_draft_dir / "config.json").read_text())
    with pytest.raises(DFlashError, match="strip-prefix"):
        load_drafter(src)  # the loader names the fix
    assert convert("strip-prefix", "--draft", src, "--out", tmp_path / "clean") == 0
    got = load_file(tmp_path / "clean" / "model.safetensors")
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    load_drafter(tmp_path / "clean")


def test_failures_leave_no_partial_output(tmp_path, random_draft_dir, capsys, monkeypatch):
    # nothing to strip
    out = tmp_path / "out"
    assert convert("strip-prefix", "--draft", random_draft_dir, "--out", out) == 2
    assert "nothing to strip" in capsys.readouterr().err
    # names still wrong after stripping: validated before anything is written
    bad = tmp_path / "bad"
    bad.mkdir()
    state = load_file(random_draft_dir / "model.safetensors")
    state.pop("norm.weight")
    save_file({f"model.{k}": v for k, v in state.items()}, bad / "model.safetensors")
    (bad / "config.json").write_text((random_draft_dir / "config.json").read_text())
    assert convert("strip-prefix", "--draft", bad, "--out", out) == 2
    assert "missing weight 'norm.weight'" in capsys.readouterr().err
    # the writer dies half-way through
    import dflash.converters.draft as draft

    def dies(path, tensors, metadata=None):
        path.write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(draft, "write_tensors", dies)
    with pytest.raises(OSError):
        draft.convert_dtype(random_draft_dir, out, "bfloat16")
    assert not out.exists() and siblings(out) == ["bad"]
    # an existing output is never overwritten
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    monkeypatch.undo()
    assert convert("dtype", "--draft", random_draft_dir, "--out", out, "--dtype", "float16") == 2
    assert "already exists" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"


def test_quantize_for_mlx_and_torch_refuses_it(tmp_path, random_draft_dir, capsys):
    pytest.importorskip("mlx.core")
    out = tmp_path / "q4"
    assert convert("quantize", "--draft", random_draft_dir, "--out", out, "--bits", 4, "--group-size", 64) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert convert("check", "--model", tmp_path / "nowhere", "--draft", out) == 2  # missing target: one line
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    from dflash.backends.mlx.drafter import load_drafter as load_mlx
    from dflash.backends.torch.drafter import load_drafter as load_torch

    assert type(load_mlx(out).fc).__name__ == "QuantizedLinear"
    with pytest.raises(DFlashError, match="MLX-quantized"):
        load_torch(out)
    assert convert("quantize", "--draft", random_draft_dir, "--out", tmp_path / "q3", "--bits", 7) == 2
    assert "--bits" in capsys.readouterr().err and not (tmp_path / "q3").exists()


def test_target_to_mlx(tmp_path, tiny_target_dir, transformers_5_llama, capsys):
    pytest.importorskip("mlx_lm")
    out = tmp_path / "mlx8"
    p = subprocess.run([sys.executable, "-m", "dflash.convert", "target-to-mlx", "--model", str(tiny_target_dir),
                        "--out", str(out), "--quantize", "--bits", "8"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 8
    # mlx-lm copies a transformers-5 config as it is: the written one carries RoPE at the top level too
    from dflash.converters.target import target_to_mlx

    written = target_to_mlx(transformers_5_llama[0], tmp_path / "t5", quiet=True)
    config = json.loads((written / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    # a directory that is not a model: one line, and no output directory
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert convert("target-to-mlx", "--model", empty, "--out", tmp_path / "never") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "never").exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_dflash2_check_dtype_and_quantize(tmp_path, tiny_target_dir, random_dflash2_dir, prompts, capsys):
    """A DFlash2 drafter through every converter: check reports its selector, dtype conversion keeps its keys and
    architecture, an MLX 4-bit copy (Linears quantized, codebooks kept in float) decodes losslessly."""
    assert convert("check", "--model", tiny_target_dir, "--draft", random_dflash2_dir) == 0
    out = capsys.readouterr().out
    assert "DFlash2DraftModel" in out and "selector         top 16 of the draft logits, rank 16" in out
    half = tmp_path / "bf16"
    assert convert("dtype", "--draft", random_dflash2_dir, "--out", half, "--dtype", "bfloat16") == 0
    cfg = json.loads((half / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_rank"] == 16
    from dflash.backends.torch.drafter import load_drafter as load_torch

    model = load_torch(half, dtype=torch.bfloat16)
    assert model.candidate_selector.predecessor_codebook.dtype == torch.bfloat16
    pytest.importorskip("mlx_lm")
    from safetensors import safe_open

    from dflash import backends
    from dflash.core.loop import generate

    q4 = tmp_path / "q4"
    assert convert("quantize", "--draft", random_dflash2_dir, "--out", q4, "--bits", 4, "--group-size", 64) == 0
    with safe_open(str(q4 / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "layers.0.attention_conv.kernel_projection.scales" in names
    assert "candidate_selector.hidden_projection.scales" in names
    assert not any(n.startswith("candidate_selector.predecessor_codebook.") for n in names)
    assert convert("check", "--model", tiny_target_dir, "--draft", q4) == 0
    mlx = backends.get("mlx")
    assert type(mlx.load_drafter(q4).layers[0].mlp_conv.kernel_projection).__name__ == "QuantizedLinear"
    quantized = mlx.load(tiny_target_dir, q4, dtype="float32", device="cpu")
    plain = mlx.load(tiny_target_dir, None, dtype="float32", device="cpu")
    for p in prompts[:2]:
        assert generate(quantized, p, max_new_tokens=32).tokens == generate(plain, p, max_new_tokens=32).tokens
