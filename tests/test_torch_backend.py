"""PyTorch backend: lossless greedy decoding, exact speculative sampling, checkpoint loading."""

import json
import shutil

import pytest
torch = pytest.importorskip("torch")

from dflash.backends.torch import load
from dflash.backends.torch.backend import torch_engine
from dflash.backends.torch.draft_cache import DraftContextCache
from dflash.backends.torch.drafter import load_drafter, save_drafter
from dflash.backends.torch.target import load_target
from dflash.core.contract import Pending
from dflash.core.errors import DFlashError
from dflash.core.loop import generate
from dflash.core.spec import DraftSpec


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(tiny_target_dir, torch.float32, "cpu")


@pytest.fixture(scope="module")
def baseline(target, prompts):
    return [generate(torch_engine(target), p, max_new_tokens=128).tokens for p in prompts]


def test_no_draft_matches_transformers_generate(target, prompts, baseline):
    for p, ours in list(zip(prompts, baseline))[:5]:
        hf = target.generate(torch.tensor([p]), max_new_tokens=128, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        assert hf[0, len(p):].tolist() == ours


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_greedy_lossless_untrained_drafter(target, random_draft_dir, prompts, baseline, block_size):
    backend = torch_engine(target, load_drafter(random_draft_dir), block_size=block_size)
    for p, ref in zip(prompts, baseline):
        r = generate(backend, p, max_new_tokens=128)  # one backend for all prompts: caches are reused/cropped
        assert r.tokens == ref


def test_draft_window_keeps_output_lossless(target, random_draft_dir, prompts, baseline):
    backend = torch_engine(target, load_drafter(random_draft_dir), draft_window=16)
    for p, ref in list(zip(prompts, baseline))[:5]:
        assert generate(backend, p, max_new_tokens=128).tokens == ref
    assert backend.drafter.cache.capacity <= 512  # bounded: entries are recycled instead of growing the buffer


def test_chunked_prefill_and_prefix_reuse(target, random_draft_dir, prompts):
    long = sum(prompts[:6], [])
    ref = generate(torch_engine(target, load_drafter(random_draft_dir)), long, max_new_tokens=48)
    chunked = torch_engine(target, load_drafter(random_draft_dir), prefill_chunk=7)
    assert generate(chunked, long, max_new_tokens=48).tokens == ref.tokens
    # a follow-up that extends the conversation reuses the cached prefix and stays exact
    follow = long + ref.tokens + prompts[7]
    fresh = generate(torch_engine(target, load_drafter(random_draft_dir)), follow, max_new_tokens=32)
    reused = generate(chunked, follow, max_new_tokens=32)
    assert reused.tokens == fresh.tokens


def test_save_load_round_trip(tmp_path, target, random_draft_dir, prompts):
    d1 = load_drafter(random_draft_dir)
    save_drafter(d1, tmp_path / "copy")
    d2 = load_drafter(tmp_path / "copy")
    for (k, a), b in zip(d1.state_dict().items(), d2.state_dict().values()):
        assert torch.equal(a, b), k
    r1 = generate(torch_engine(target, d1), prompts[0], max_new_tokens=40, trace=True)
    r2 = generate(torch_engine(target, d2), prompts[0], max_new_tokens=40, trace=True)
    assert r1.tokens == r2.tokens and r1.drafted == r2.drafted


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs(tiny_target_dir, random_draft_dir, prompts, dtype):
    backend = load(tiny_target_dir, random_draft_dir, dtype=dtype, device="cpu")
    assert backend.target.dtype == getattr(torch, dtype)
    r = generate(backend, prompts[0], max_new_tokens=16)
    assert r.generation_tokens == 16


def _edit_weights(src, dst, edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors")


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("layers.1.mlp.up_proj.weight"), "missing weight 'layers.1.mlp.up_proj.weight'"),
    (lambda s: s.update({"layers.0.extra.weight": torch.zeros(2)}), "unexpected weight 'layers.0.extra.weight'"),
    (lambda s: s.update({"fc.weight": torch.zeros(3, 3)}), r"weight 'fc.weight' has shape \[3, 3\]"),
    (lambda s: s.update({"embed_tokens.weight": torch.zeros(3, 3)}), "must not contain its own"),
    (lambda s: [s.__setitem__("model." + k, s.pop(k)) for k in list(s)], "prefix 'model.'"),
])
def test_bad_weights_fail_with_one_line(tmp_path, random_draft_dir, edit, message):
    _edit_weights(random_draft_dir, tmp_path / "bad", edit)
    with pytest.raises(DFlashError, match=message) as e:
        load_drafter(tmp_path / "bad")
    assert "\n" not in str(e.value)


def test_truncated_safetensors(tmp_path, random_draft_dir):
    bad = tmp_path / "bad"
    shutil.copytree(random_draft_dir, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DFlashError, match="truncated"):
        load_drafter(bad)


def test_incompatible_config_fails_before_loading(tmp_path, tiny_target_dir, random_draft_dir):
    bad = tmp_path / "bad"
    shutil.copytree(random_draft_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 9]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match=r"target_layer_ids \[9\] out of range"):
        load(tiny_target_dir, bad, device="cpu")


@pytest.fixture(scope="module")
def trained(trained_pair):
    target_dir, draft_dir = trained_pair
    model = load_target(target_dir, torch.float32, "cpu")
    g = torch.Generator().manual_seed(123)  # fresh prompts, not the training ones
    prompts = torch.randint(3, 500, (20, 8), generator=g).tolist()
    baseline = [generate(torch_engine(model), p, max_new_tokens=128).tokens for p in prompts]
    return model, load_drafter(draft_dir), prompts, baseline


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_greedy_lossless_trained_drafter(trained, block_size):
    model, drafter, prompts, baseline = trained
    backend = torch_engine(model, drafter, block_size=block_size)
    lengths = []
    for p, ref in zip(prompts, baseline):
        r = generate(backend, p, max_new_tokens=128)
        assert r.tokens == ref
        lengths += r.acceptance_lengths
    # long and partial acceptances both happen, so every crop path is exercised
    assert sum(lengths) / len(lengths) > (1.6 if block_size == 2 else 2.5)
    if block_size > 2:
        assert {1, block_size} <= set(lengths) and any(1 < n < block_size for n in lengths)


def test_draft_cache_rows_join_into_spare_room_and_leave_in_order(random_draft_dir):
    """The torch draft cache keeps spare rows: joins copy one row, leaves move only the rows after the first gone,
    and every live row holds exactly what it held (the same as concatenating and indexing whole buffers)."""
    spec = DraftSpec.load(random_draft_dir)

    def row(seed: int, length: int, capacity: int) -> DraftContextCache:
        g = torch.Generator().manual_seed(seed)
        shape = (spec.num_hidden_layers, 1, spec.num_key_value_heads, capacity, spec.head_dim)
        return DraftContextCache.holding(spec, torch.randn(shape, generator=g), torch.randn(shape, generator=g),
                                         [length])

    rows = [row(i, 5 + i, 8 if i % 2 else 16) for i in range(5)]
    live = [(r.k[:, 0, :, :r.layout.lengths[0]].clone(), r.layout.lengths[0]) for r in rows]
    batch = row(0, 5, 16)
    for r in rows[1:]:
        batch.merge(r)
    assert batch.allocated_rows >= 5 and batch.k.shape[1] == 5 and batch.lengths == [5, 6, 7, 8, 9]
    batch.select([0, 2, 4])
    live = [live[i] for i in (0, 2, 4)]
    batch.merge(row(9, 3, 8))  # into a freed row: its stale slots past length 3 are never read
    live.append((row(9, 3, 8).k[:, 0, :, :3].clone(), 3))
    assert batch.lengths == [n for _, n in live] and batch.allocated_rows == 8  # (spare rows: 1, 2, 4, 8)
    for i, (k, n) in enumerate(live):
        assert torch.equal(batch.k[:, i, :, :n], k)
    alone = batch.extract(2)
    assert alone.lengths == [live[2][1]] and torch.equal(alone.k[:, 0, :, :live[2][1]], live[2][0])
    assert alone.nbytes < batch.nbytes


def test_rows_join_and_leave_after_a_draft_forward_grew_the_cache(target, random_draft_dir):
    """A context buffer grown inside a draft forward (an inference tensor) still takes a joining row into its spare
    room, a leaving row, a crop and an extract: those writes outside a forward once raised 'Inplace update to
    inference tensor' in the server (a join after a long row's context outgrew the buffer)."""
    engine = torch_engine(target, load_drafter(random_draft_dir, torch.float32, "cpu"))
    batch, width = engine.drafter, engine.drafter.width

    def row(n: int):
        r = batch.spawn()
        r.extend(Pending(torch.randn(1, n, width), [n]))
        return r

    batch.extend(Pending(torch.randn(1, 4, width), [4]))
    batch.merge(row(6))
    batch.select([0])  # a spare row in the buffer
    capacity = batch.cache.capacity
    batch.extend(Pending(torch.randn(1, capacity, width), [capacity]))  # past the buffer: grown in the mode
    assert batch.cache.k.is_inference() and batch.cache.allocated_rows == 2
    batch.merge(row(5))  # into the spare row, in place
    assert batch.cache.lengths == [capacity + 4, 5]
    assert batch.extract(1).cache.lengths == [5]
    batch.select([1])
    assert batch.cache.lengths == [5]
    batch.crop(3)
    assert batch.position == 3


def test_feature_capture_wraps_the_layers_without_hooks_and_unwraps_in_either_order(tiny_target_dir):
    """The captured layers' outputs are hidden_states[i + 1]; no forward hook is left on a layer (a hook sends every
    call through nn.Module's slow path); two captures on one model record both and come off in either order, leaving
    each layer its class's own forward."""
    from dflash.backends.torch.target import LayerCapture, decoder_layers

    model = load_target(tiny_target_dir, torch.float32, "cpu")
    layers = decoder_layers(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():  # (on another instance: transformers leaves hooks on the layers it recorded)
        reference = load_target(tiny_target_dir, torch.float32, "cpu")
        hidden = reference(input_ids=ids, output_hidden_states=True).hidden_states
    for order in ((0, 1), (1, 0)):
        captures = [LayerCapture(model, [0, 1]), LayerCapture(model, [1])]
        assert not any(layer._forward_hooks for layer in layers)
        with torch.inference_mode():
            model(input_ids=ids)
        torch.testing.assert_close(captures[0].pop(), torch.cat([hidden[1], hidden[2]], dim=-1))
        torch.testing.assert_close(captures[1].pop(), hidden[2])
        for k in order:
            captures[k].remove()
        assert not any("forward" in layer.__dict__ for layer in layers)
        with torch.inference_mode():
            model(input_ids=ids)
        assert not captures[0].outputs and not captures[1].outputs
