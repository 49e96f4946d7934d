"""Self-prompted answers in refilled lanes (backends/torch/answer_lanes.py) on a tiny ChatML target: every greedy
answer is generate()'s greedy continuation of its conversation, lanes refill while others go on, the shards resume
without repeating a request, and an interrupted run keeps what it wrote."""

import pytest

torch = pytest.importorskip("torch")
from transformers import AutoTokenizer

from dflash.backends.torch.answer_lanes import AnswerLanes, Settings, assistant_header, sample_step, write_answers
from dflash.backends.torch.self_prompts import normalise, user_turn_prefix
from dflash.backends.torch.target import load_target
from dflash.core.model_files.tokenizer import eos_token_ids
from dflash.core.training.answer_shards import count, read_rows

SETTINGS = Settings(max_prompt_tokens=48, max_answer_tokens=20, min_prompt_chars=1)


def _lanes(target_dir, lanes=3, **settings):
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = load_target(target_dir, torch.float32, "cpu")
    end = set(eos_token_ids(target_dir, tok))
    settings = Settings(**{**SETTINGS.__dict__, **settings})
    return AnswerLanes(model, tok, [None, "You write Python."], [0.5, 0.5], end, lambda text: None, lanes=lanes,
                       settings=settings, seed=1), model, tok, end


def test_greedy_answers_are_the_targets_own_continuations(tiny_target_dir):
    writer, model, tok, end = _lanes(tiny_target_dir, sampled_fraction=0.0)
    rows = []
    while len(rows) < 7:  # more conversations than lanes: refilled lanes' answers are checked too
        rows += writer.step()
    header = assistant_header(tok, end)
    for row in rows:
        system = [None, "You write Python."][row.system]
        prefix = tok(user_turn_prefix(tok, system), add_special_tokens=False)["input_ids"]
        assert row.ids[:len(prefix)] == prefix and row.ids[row.answer_start - len(header):row.answer_start] == header
        answer = row.ids[row.answer_start:]
        assert not row.sampled and row.finished == (answer[-1] in end)
        context = torch.tensor([row.ids[:row.answer_start]])
        expected = model.generate(context, attention_mask=torch.ones_like(context), do_sample=False,
                                  max_new_tokens=len(answer), eos_token_id=sorted(end), pad_token_id=sorted(end)[0])
        assert expected[0, row.answer_start:].tolist() == answer


def test_sampled_lanes_are_marked_and_greedy_breaks_ties_as_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0] + [0.0] * 60, [5.0, 5.0] + [0.0] * 62])
    picked = sample_step(logits, torch.zeros(2), 0.95, torch.Generator().manual_seed(0))
    assert picked.tolist() == logits.argmax(-1).tolist() == [1, 0]
    logits = torch.zeros(1, 64)
    logits[0, 7] = 50.0  # all the mass on one token: a draw at any temperature takes it
    assert sample_step(logits, torch.ones(1), 0.95, torch.Generator().manual_seed(0)).tolist() == [7]


def test_sampled_answers_are_marked(tiny_target_dir):
    writer = _lanes(tiny_target_dir, sampled_fraction=1.0)[0]
    rows = []
    while len(rows) < 3:
        rows += writer.step()
    assert all(r.sampled for r in rows)


def _write(target_dir, out, n, **kw):
    return write_answers(target_dir, out, answers=n, lanes=3, settings=SETTINGS, shard_rows=2, device="cpu",
                         dtype="float32", progress=False, log=lambda m: None, **kw)


def test_resumes_in_whole_shards_and_never_repeats_a_request(tiny_target_dir, tmp_path):
    assert _write(tiny_target_dir, tmp_path, 3)["answers"] == 3
    stats = _write(tiny_target_dir, tmp_path, 6)
    assert stats["written"] == 3 and count(tmp_path) == {**count(tmp_path), "shards": 4, "answers": 6}
    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    header = assistant_header(tok, set(eos_token_ids(tiny_target_dir, tok)))
    requests = [normalise(tok.decode(r.ids[:r.answer_start - len(header)], skip_special_tokens=True))
                for r in read_rows(tmp_path)]
    assert len(set(requests)) == 6
    assert _write(tiny_target_dir, tmp_path, 6)["written"] == 0


def test_an_interrupted_run_keeps_its_answers(tiny_target_dir, tmp_path, monkeypatch):
    returned = []
    step = AnswerLanes.step

    def interrupted(self):  # Ctrl-C in the step after the first answers came back (half a shard)
        if returned:
            raise KeyboardInterrupt
        rows = step(self)
        returned.extend(rows)
        return rows

    monkeypatch.setattr(AnswerLanes, "step", interrupted)
    _write(tiny_target_dir, tmp_path, 50)
    assert count(tmp_path)["answers"] == len(returned) > 0  # the shard under way was written, not lost


def cpu_seconds(pid: int, default: float) -> float:
    """A process's CPU seconds so far (Linux's /proc); `default` where that cannot be read."""
    import os
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return default


def test_a_kill_keeps_the_answers_of_the_shard_under_way(tiny_target_dir, tmp_path):
    """SIGTERM (and SIGINT, which a shell's background job ignores) stop the writer after its step."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = ("from dflash.backends.torch.answer_lanes import Settings, write_answers\n"
            f"write_answers({str(tiny_target_dir)!r}, {str(tmp_path)!r}, answers=10**6, lanes=3, shard_rows=10**6, "
            "settings=Settings(max_prompt_tokens=48, max_answer_tokens=20, min_prompt_chars=1), device='cpu', "
            "dtype='float32', progress=False)")
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (tmp_path / "manifest.json").exists():
        time.sleep(0.2)
    # some answers finish (the tiny target writes a few a second of its own CPU time: counted in CPU seconds, so a
    # busy machine does not stop it before its first answer)
    start = time.monotonic()
    while time.monotonic() - start < 120 and cpu_seconds(proc.pid, default=time.monotonic() - start) < 8:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert "interrupted: keeping the" in out, out
    assert count(tmp_path)["answers"] > 0
