"""The trained_pair fixture: a drafter that gets long acceptances on its tiny target, loadable by dflash.load."""

from __future__ import annotations


def test_trained_pair_long_acceptance(trained_pair):
    import json

    import dflash
    from tiny_pair import PROMPT_LEN

    target_dir, draft_dir = trained_pair
    info = json.loads((draft_dir.parent.parent / "pair.json").read_text())
    pipe = dflash.load(str(target_dir), str(draft_dir), backend="torch", device="cpu", dtype="float32")
    lengths = []
    for p in info["eval_prompts"]:
        r = pipe.generate(p, max_new_tokens=64)
        lengths += r.acceptance_lengths
    tau = sum(lengths) / len(lengths)
    assert tau >= 3.0
    assert len(info["eval_prompts"][0]) == PROMPT_LEN
