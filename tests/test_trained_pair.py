"""The trained_pair fixture: a drafter that gets long acceptances on its tiny target, loadable by dflash.load."""

from __future__ import annotations


def test_trained_pair_long_acceptance(trained_pair):
    import json

    import dflash
    from tiny_pair import PROMPT_LEN

    target_dir, draft_dir = trained_pair
    info = json.loads((draft_dir.parent.parent / "pair.json").read_text())
    # the chain the pair was trained for: under auto (the default) the verified shape follows timings measured on
    # this machine at load and per cycle, and a busy CI machine once made it take plain steps (tau 1.85)
    pipe = dflash.load(str(target_dir), str(draft_dir), backend="torch", device="cpu", dtype="float32",
                       verify="chain")
    lengths = []
    for p in info["eval_prompts"]:
        r = pipe.generate(p, max_new_tokens=64)
        lengths += r.acceptance_lengths
    tau = sum(lengths) / len(lengths)
    assert tau >= 3.0
    assert len(info["eval_prompts"][0]) == PROMPT_LEN
