"""Training with a draft vocabulary (--draft-vocab N) and giving a drafter one (python -m dflash.data draft-vocab):
the vocabulary is the N tokens most frequent among the supervised answer tokens, the head is the target's rows and
stays frozen, slots labelled outside the vocabulary carry no loss (EAGLE-3's rule) in the objective and in the global
normaliser alike, and what comes out loads, keeps greedy output exact, and round-trips on MLX."""

import json
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from dflash import backends
from dflash.backends.torch.drafter import load_drafter, with_draft_vocab
from dflash.backends.torch.target import load_target
from dflash.backends.torch.training import TrainConfig, train
from dflash.backends.torch.training.data import sample_weight
from dflash.backends.torch.training.objective import build_blocks, draft_labels, sample_anchors
from dflash.core.draft_vocab import select_tokens
from dflash.core.loop import generate

SIZE = 96


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """Tokenised rows whose answers favour the low ids (so the ranking is not the identity), prompts unsupervised."""
    g = torch.Generator().manual_seed(0)
    path = tmp_path_factory.mktemp("answers") / "answers.jsonl"
    with open(path, "w") as f:
        for i in range(12):
            n = int(torch.randint(24, 40, (1,), generator=g))
            ids = (torch.randint(3, 500, (n,), generator=g) % torch.randint(40, 500, (n,), generator=g) + 3).tolist()
            f.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [0] * 4 + [1] * (n - 4)}) + "\n")
    return path


def rows(path):
    return [json.loads(line) for line in open(path)]


def ranked(path, vocab_size):
    counts = Counter(t for r in rows(path) for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    return select_tokens(counts, SIZE, vocab_size)


def test_off_vocabulary_labels_carry_no_loss_in_the_objective_and_the_normaliser(tiny_target_dir, random_draft_dir,
                                                                                 answers):
    model = load_target(tiny_target_dir, torch.float32, "cpu")
    vocab = ranked(answers, model.config.vocab_size)
    drafter = with_draft_vocab(load_drafter(random_draft_dir), vocab, model.get_output_embeddings().weight)
    sample = rows(answers)[0]
    ids, mask = torch.tensor([sample["input_ids"]]), torch.tensor([sample["loss_mask"]], dtype=torch.bool)
    anchors, valid = sample_anchors(mask, 8, torch.Generator().manual_seed(3))
    _, _, labels, weights = build_blocks(ids, mask, anchors, valid, 4, 0, 4.0)
    mapped, kept = draft_labels(drafter, labels, weights)
    inside = torch.tensor([t in vocab for t in labels.flatten().tolist()]).view_as(labels)
    assert (~inside & (weights > 0)).any() and (inside & (weights > 0)).any()  # both kinds are supervised here
    assert torch.equal(kept, torch.where(inside, weights, 0.0))
    assert [vocab[i] for i in mapped[kept > 0].tolist()] == labels[kept > 0].tolist()  # draft id -> the same token
    assert sample_weight(sample, anchors[0], valid[0], 4, 4.0, drafter.t2d) == pytest.approx(float(kept.sum()))


def test_a_run_with_a_draft_vocabulary(tiny_target_dir, answers, tmp_path):
    cfg = TrainConfig(target=str(tiny_target_dir), data=str(answers), out=str(tmp_path / "run"), num_layers=1,
                      block_size=4, num_anchors=8, max_steps=3, lr=3e-3, save_every=0, progress=False, plot=False,
                      quiet=True, device="cpu", eval_at_end=False, draft_vocab=SIZE)
    result = train(cfg)
    assert all(loss == loss for loss in result.losses)  # finite (NaN != NaN)
    model = load_target(tiny_target_dir, torch.float32, "cpu")
    drafter = load_drafter(result.draft_dir)
    vocab = ranked(answers, model.config.vocab_size)
    assert drafter.spec.draft_vocab_size == SIZE and drafter.target_ids().tolist() == vocab
    assert torch.equal(drafter.lm_head.weight, model.get_output_embeddings().weight[vocab])  # frozen
    engine = backends.get("torch").load(tiny_target_dir, result.draft_dir, dtype="float32", device="cpu")
    plain = backends.get("torch").load(tiny_target_dir, None, dtype="float32", device="cpu")
    prompt = rows(answers)[1]["input_ids"][:4]
    assert generate(engine, prompt, max_new_tokens=24).tokens == generate(plain, prompt, max_new_tokens=24).tokens


def test_data_command_gives_a_drafter_a_vocabulary(tiny_target_dir, random_draft_dir, answers, tmp_path, capsys):
    from dflash.data import main

    out = tmp_path / "with_vocab"
    assert main(["draft-vocab", "--model", str(tiny_target_dir), "--data", str(answers), "--draft",
                 str(random_draft_dir), "--size", str(SIZE), "--out", str(out)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["draft_vocab_size"] == SIZE and 0 < stats["coverage"] < 1
    model = load_target(tiny_target_dir, torch.float32, "cpu")
    drafter, source = load_drafter(out), load_drafter(random_draft_dir)
    assert drafter.target_ids().tolist() == ranked(answers, model.config.vocab_size)
    layers = {k: v for k, v in source.state_dict().items()}
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in layers.items())  # the layers unchanged
    pytest.importorskip("mlx_lm")
    on_mlx = backends.get("mlx").load(tiny_target_dir, out, dtype="float32", device="cpu")
    plain = backends.get("mlx").load(tiny_target_dir, None, dtype="float32", device="cpu")
    prompt = rows(answers)[2]["input_ids"][:4]
    assert generate(on_mlx, prompt, max_new_tokens=24).tokens == generate(plain, prompt, max_new_tokens=24).tokens
