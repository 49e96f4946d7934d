"""Draft vocabularies (dflash.core.draft_vocab): the ranking, the maps, their storage as speculators writes it and
vLLM reads it (config.json draft_vocab_size; lm_head.weight, d2t int64 offsets, t2d bool) through save / load on both
backends and the dtype converter, the draft logits equal to the target head's restricted to the vocabulary, greedy
output equal to target-only output (torch, MLX, and the same drafts on both), sampled output still exactly the
target's (chi-square), and the training objective's handling of labels outside the vocabulary."""

import json

import pytest

torch = pytest.importorskip("torch")

from dflash import backends
from dflash.backends.torch.draft_runner import TorchDraft
from dflash.backends.torch.drafter import DFlashDrafter, load_drafter, save_drafter, with_draft_vocab
from dflash.backends.torch.target import load_target
from dflash.core.model_files.checkpoint import read_header
from dflash.core.draft_vocab import check_maps, count_answer_tokens, select_tokens, vocab_maps
from dflash.core.errors import DFlashError
from dflash.core.loop import generate
from dflash.core.spec import DraftSpec
from dflash.reference import tiny

from test_sampling_rules import N, V, lossless, sampled, small_vocab_pair  # noqa: F401 (a fixture)

# every third id from 5: a vocabulary that leaves out most of the target's likely tokens
VOCAB = list(range(5, 300, 3))


def test_ranking_ties_padding_and_offsets():
    counts = {7: 5, 3: 5, 9: 2, 1: 9}
    assert select_tokens(counts, 3, 16) == [1, 3, 7]  # by count, the smaller id first on a tie; then ascending
    assert select_tokens(counts, 6, 16) == [0, 1, 2, 3, 7, 9]  # padded with the smallest unseen ids
    d2t, t2d = vocab_maps([1, 3, 7], 10)
    assert d2t == [1, 2, 5] and [i + o for i, o in enumerate(d2t)] == [1, 3, 7]  # target id = draft id + d2t
    assert t2d == [i in (1, 3, 7) for i in range(10)]
    assert check_maps(d2t, t2d, 10, "x") == [1, 3, 7]
    with pytest.raises(DFlashError, match="1..16"):
        select_tokens(counts, 17, 16)
    with pytest.raises(DFlashError, match="outside the target's vocabulary"):
        select_tokens({20: 1}, 1, 16)
    with pytest.raises(DFlashError, match="d2t\\[2\\].*outside"):
        check_maps([1, 2, 9], t2d, 10, "x")
    with pytest.raises(DFlashError, match="t2d does not mark"):
        check_maps(d2t, [True] * 10, 10, "x")
    samples = [{"input_ids": [4, 5, 5, 6], "loss_mask": [False, True, True, False]}]
    assert count_answer_tokens(samples) == {5: 2}  # supervised (assistant) tokens only


def test_config_field(tiny_target_dir):
    from dflash.core.model_files.checkpoint import expected_shapes

    spec = tiny.draft_spec_for(tiny_target_dir, num_layers=1, block_size=4)
    cfg = spec.to_dict()
    with_vocab = DraftSpec.from_dict(dict(cfg, draft_vocab_size=100))
    assert with_vocab.has_draft_vocab and with_vocab.to_dict()["draft_vocab_size"] == 100
    assert expected_shapes(with_vocab)["d2t"] == (100,) and "lm_head.weight" not in expected_shapes(spec)
    whole = DraftSpec.from_dict(dict(cfg, draft_vocab_size=spec.vocab_size))  # N = V: no draft vocabulary (vLLM)
    assert not whole.has_draft_vocab and whole.to_dict()["draft_vocab_size"] == spec.vocab_size
    for bad in (0, spec.vocab_size + 1, "100"):
        with pytest.raises(DFlashError, match="draft_vocab_size"):
            DraftSpec.from_dict(dict(cfg, draft_vocab_size=bad))
    dflash2 = tiny.dflash2_spec(spec).to_dict()
    with pytest.raises(DFlashError, match="supported for DFlashDraftModel only"):
        DraftSpec.from_dict(dict(dflash2, draft_vocab_size=100))


@pytest.fixture(scope="module")
def vocab_pair(tmp_path_factory, tiny_target_dir):
    """(target model, plain drafter dir, the same drafter with the VOCAB draft vocabulary)."""
    root = tmp_path_factory.mktemp("draft_vocab")
    model = load_target(tiny_target_dir, torch.float32, "cpu")
    torch.manual_seed(1)
    drafter = DFlashDrafter(tiny.draft_spec_for(tiny_target_dir, num_layers=2, block_size=8)).eval()
    save_drafter(drafter, root / "plain")
    save_drafter(with_draft_vocab(drafter, VOCAB, model.get_output_embeddings().weight), root / "vocab")
    return model, root / "plain", root / "vocab"


def test_a_drafter_without_one_keeps_the_public_format(vocab_pair):
    _, plain, _ = vocab_pair
    assert "draft_vocab_size" not in json.loads((plain / "config.json").read_text())
    assert not any(k in read_header(plain / "model.safetensors") for k in ("lm_head.weight", "d2t", "t2d"))


def test_storage_round_trips_on_both_backends(vocab_pair):
    model, _, vocab = vocab_pair
    assert json.loads((vocab / "config.json").read_text())["draft_vocab_size"] == len(VOCAB)
    header = read_header(vocab / "model.safetensors")
    assert header["d2t"] == ("I64", (len(VOCAB),)) and header["t2d"] == ("BOOL", (model.config.vocab_size,))
    assert header["lm_head.weight"] == ("F32", (len(VOCAB), model.config.hidden_size))
    back = load_drafter(vocab)
    assert back.target_ids().tolist() == VOCAB
    assert torch.equal(back.lm_head.weight, model.get_output_embeddings().weight[VOCAB])
    mx = pytest.importorskip("mlx.core")
    from dflash.backends.mlx.drafter import load_drafter as load_mlx

    on_mlx = load_mlx(vocab)
    assert on_mlx.target_ids().tolist() == VOCAB and on_mlx.t2d.dtype == mx.bool_
    assert torch.equal(torch.tensor(on_mlx.lm_head.weight.tolist()), back.lm_head.weight)


def test_the_dtype_converter_carries_the_maps(vocab_pair, tmp_path):
    from dflash.converters.draft import convert_dtype

    _, _, vocab = vocab_pair
    convert_dtype(vocab, tmp_path / "bf16", "bfloat16")
    header = read_header(tmp_path / "bf16" / "model.safetensors")
    assert header["d2t"][0] == "I64" and header["t2d"][0] == "BOOL" and header["lm_head.weight"][0] == "BF16"
    assert load_drafter(tmp_path / "bf16").target_ids().tolist() == VOCAB
    assert DraftSpec.load(tmp_path / "bf16").draft_vocab_size == len(VOCAB)
    pytest.importorskip("mlx.core")
    from dflash.backends.mlx.drafter import load_drafter as load_mlx

    assert load_mlx(tmp_path / "bf16").target_ids().tolist() == VOCAB


def test_mlx_quantization_keeps_the_maps_and_the_check_reports_them(vocab_pair, tiny_target_dir, tmp_path, prompts):
    pytest.importorskip("mlx_lm")
    from dflash.converters import compat
    from dflash.converters.quantize import quantize_drafter

    _, _, vocab = vocab_pair
    quantize_drafter(vocab, tmp_path / "q8", bits=8, group_size=32)
    header = read_header(tmp_path / "q8" / "model.safetensors")
    assert header["lm_head.weight"][0] == "U32" and header["d2t"][0] == "I64" and header["t2d"][0] == "BOOL"
    quantized, plain = run_both(tiny_target_dir, tmp_path / "q8", "mlx"), run_both(tiny_target_dir, None, "mlx")
    assert generate(quantized, prompts[0], max_new_tokens=24).tokens == \
        generate(plain, prompts[0], max_new_tokens=24).tokens
    report = compat.report_lines(compat.check(tiny_target_dir, vocab))
    assert any(f"draft vocabulary of {len(VOCAB)}" in line for line in report)


def test_bad_maps_are_refused(vocab_pair, tmp_path):
    from safetensors.torch import load_file, save_file

    _, _, vocab = vocab_pair
    (tmp_path / "config.json").write_text((vocab / "config.json").read_text())
    state = load_file(vocab / "model.safetensors")
    save_file({**state, "d2t": state["d2t"] + 10_000}, tmp_path / "model.safetensors")
    with pytest.raises(DFlashError, match="d2t\\[0\\].*outside the target's vocabulary"):
        load_drafter(tmp_path)
    save_file({**state, "t2d": state["t2d"].to(torch.uint8)}, tmp_path / "model.safetensors")
    with pytest.raises(DFlashError, match="'t2d' has dtype U8, expected BOOL"):
        load_drafter(tmp_path)
    save_file({k: v for k, v in state.items() if k != "d2t"}, tmp_path / "model.safetensors")
    with pytest.raises(DFlashError, match="missing weight 'd2t'"):
        load_drafter(tmp_path)


def test_draft_logits_are_the_full_logits_restricted(vocab_pair):
    model, plain, vocab = vocab_pair
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    hidden = torch.randn(2, 7, model.config.hidden_size)
    full = TorchDraft(load_drafter(plain), embed, head).logits(hidden)
    restricted = TorchDraft(load_drafter(vocab), embed, head).logits(hidden)
    assert torch.equal(restricted[..., VOCAB], full[..., VOCAB])
    off = torch.ones(full.shape[-1], dtype=torch.bool)
    off[VOCAB] = False
    assert torch.isneginf(restricted[..., off]).all()
    np = pytest.importorskip("numpy")
    mx = pytest.importorskip("mlx.core")
    from dflash.backends.mlx.drafter import load_drafter as load_mlx
    from dflash.backends.mlx.drafter import scale_logits, spread

    drafter = load_mlx(vocab)
    on_mlx = spread(scale_logits(drafter.lm_head(mx.array(hidden.numpy())), 1.0, None), drafter.target_ids(),
                    model.config.vocab_size)
    assert np.allclose(np.array(on_mlx)[..., VOCAB], full[..., VOCAB].numpy(), atol=1e-5)
    assert np.isneginf(np.array(on_mlx)[..., off.numpy()]).all()


def run_both(target_dir, draft_dir, backend, **kw):
    return backends.get(backend).load(target_dir, draft_dir, dtype="float32", device="cpu", **kw)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_greedy_output_is_the_targets(vocab_pair, tiny_target_dir, prompts, backend):
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    _, _, vocab = vocab_pair
    spec, plain = run_both(tiny_target_dir, vocab, backend), run_both(tiny_target_dir, None, backend)
    for p in prompts[:4]:
        a = generate(spec, p, max_new_tokens=40, trace=True)
        assert a.tokens == generate(plain, p, max_new_tokens=40).tokens
        assert {t for cycle in a.drafted for t in cycle} <= set(VOCAB)  # proposals come from the vocabulary only


def test_both_backends_draft_the_same(vocab_pair, tiny_target_dir, prompts):
    pytest.importorskip("mlx_lm")
    _, _, vocab = vocab_pair
    tb, mb = run_both(tiny_target_dir, vocab, "torch"), run_both(tiny_target_dir, vocab, "mlx")
    for p in prompts[:3]:
        a, b = generate(tb, p, max_new_tokens=40, trace=True), generate(mb, p, max_new_tokens=40, trace=True)
        assert a.tokens == b.tokens and a.drafted == b.drafted


@pytest.mark.parametrize("backend", ["torch", pytest.param("mlx", marks=pytest.mark.slow)])
def test_sampled_output_stays_exact(small_vocab_pair, backend):
    """Rejection sampling with a draft vocabulary of 10 of 16 tokens: q is 0 on the other 6, which the target still
    emits (through the residual), and the joint of two emitted tokens is the target-only one (chi-square)."""
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    model, drafter, directory = small_vocab_pair
    vocab = [1, 2, 3, 5, 6, 8, 9, 11, 12, 14]
    restricted = with_draft_vocab(drafter, vocab, model.get_output_embeddings().weight).eval()
    save_drafter(restricted, directory / "draft")
    pair = (model, restricted, directory)
    observed, depth = sampled(pair, "rejection", backend)
    assert depth[1:].sum() > N * 0.1  # draft tokens are kept ...
    assert observed[[t for t in range(V) if t not in vocab]].sum() > N * 0.05  # ... and off-vocabulary ones emitted
    ok, why = lossless(pair, observed)
    assert ok, why
