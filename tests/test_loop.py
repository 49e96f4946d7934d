"""The core loop's policy over the engine on numpy fakes: commits, EOS, max_new_tokens, stop strings, stats."""

import pytest
from fakes import FakeDrafter, FakeTarget

from dflash.core.engine import Engine
from dflash.core.errors import DFlashError
from dflash.core.loop import Generation, generate, generate_batch
from dflash.core.sampling import SamplingParams, accepted_length

V = 50


def next_token(history):
    return (history[-1] * 7 + len(history)) % V


class FakeTokenizer:
    """Token i decodes to one character."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 \n.,:;()[]{}+-*/"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.alphabet[i] for i in ids)


def fake_engine(block_size=8, good=3):
    """The engine over numpy fakes: target = next_token(); the drafter is right for the first `good` slots of every
    block, then wrong."""
    return Engine(FakeTarget(rule=next_token, vocab=V), FakeDrafter(good, rule=next_token, vocab=V),
                  block_size=block_size)


def reference(prompt, n):
    hist = list(prompt)
    for _ in range(n):
        hist.append(next_token(hist))
    return hist[len(prompt):]


@pytest.mark.parametrize("good", [0, 2, 7])
def test_commits_equal_target_only(good):
    r = generate(fake_engine(8, good), [1, 2, 3], max_new_tokens=40)
    assert r.tokens == reference([1, 2, 3], 40)
    assert r.finish_reason == "length"
    assert set(r.acceptance_lengths[:-1]) == {good + 1}
    assert len(r.acceptance_lengths) == (40 - 1 + good) // (good + 1)  # prefill token is not a cycle


def test_generate_batch_reports_each_row_the_cycle_it_finishes():
    prompts = [[1, 2, 3], [4], [5, 6]]
    eos = reference(prompts[0], 60)[4]  # row 0 stops early; the others run on to max_new_tokens (or their own EOS)
    cycles = []
    results = generate_batch(fake_engine(8, 2), prompts, max_new_tokens=40, eos_token_ids=[eos],
                             on_cycle=lambda tokens, finished: cycles.append((tokens, finished)))
    reported = {i: (c, r) for c, (_, finished) in enumerate(cycles) for i, r in finished}
    assert sorted(reported) == [0, 1, 2] and all(reported[i][1] is results[i] for i in range(3))
    assert sum(tokens for tokens, _ in cycles) == sum(r.generation_tokens for r in results)
    assert results[0].finish_reason == "stop" and reported[0][0] < len(cycles) - 1  # kept before the batch ended


@pytest.mark.parametrize("n", [1, 2, 5, 9, 16, 17])
def test_max_new_tokens_is_exact(n):
    r = generate(fake_engine(8, 7), [4], max_new_tokens=n)
    assert r.tokens == reference([4], n) and r.finish_reason == "length"


def test_eos_inside_an_accepted_block_ends_there():
    ref = reference([1, 2, 3], 60)
    eos = ref[12]  # lands inside the second 8-token cycle
    cut = ref.index(eos)
    r = generate(fake_engine(8, 7), [1, 2, 3], max_new_tokens=60, eos_token_ids=[eos])
    assert r.tokens == ref[: cut + 1] and r.finish_reason == "stop"


def test_eos_as_last_allowed_token_is_stop():
    ref = reference([1, 2, 3], 10)
    r = generate(fake_engine(8, 7), [1, 2, 3], max_new_tokens=ref.index(ref[5]) + 1, eos_token_ids=[ref[5]])
    assert r.finish_reason == "stop"


def test_stop_string_cuts_text_and_tokens_and_streams_nothing_past_it():
    tok = FakeTokenizer()
    ref = reference([1, 2, 3], 60)
    text = tok.decode(ref)
    stop = text[20:23]
    at = text.index(stop)
    gen = Generation(fake_engine(8, 7), [1, 2, 3], tokenizer=tok, max_new_tokens=60, stop_strings=[stop])
    streamed = "".join(inc.text for inc in gen)
    r = gen.result
    assert r.text == text[:at] == streamed
    assert r.finish_reason == "stop"
    assert tok.decode(r.tokens) == text[: at + len(stop)]  # fewest tokens that reach the stop string


def test_stream_increments_add_up():
    tok = FakeTokenizer()
    gen = Generation(fake_engine(8, 3), [5, 6], tokenizer=tok, max_new_tokens=33)
    incs = list(gen)
    assert sum((i.tokens for i in incs), []) == gen.result.tokens
    assert "".join(i.text for i in incs) == gen.result.text == tok.decode(gen.result.tokens)


def test_stats_and_json():
    r = generate(fake_engine(8, 3), [1], max_new_tokens=30, trace=True)
    j = r.to_json(trace=True)
    assert j["generation_tokens"] == 30 == len(j["tokens"])
    assert j["mean_acceptance_length"] == sum(j["acceptance_lengths"]) / len(j["acceptance_lengths"])
    assert all(len(d) == 7 for d in j["drafted"]) and len(j["drafted"]) == len(j["acceptance_lengths"])


def test_accepted_length():
    assert accepted_length([1, 2, 3], [1, 2, 9, 4]) == 2
    assert accepted_length([5], [1, 5]) == 0
    assert accepted_length([], [7]) == 0


@pytest.mark.parametrize("kwargs, flag", [
    (dict(temperature=-1.0), "--temperature"), (dict(temperature=float("nan")), "--temperature"),
    (dict(top_p=0.0), "--top-p"), (dict(top_k=-2), "--top-k"), (dict(min_p=1.5), "--min-p"),
    (dict(repetition_penalty=0.0), "--repetition-penalty"),
])
def test_bad_sampling_values(kwargs, flag):
    with pytest.raises(DFlashError, match=flag):
        SamplingParams(**kwargs).validate()


def test_empty_prompt():
    with pytest.raises(DFlashError, match="empty"):
        generate(fake_engine(), [], max_new_tokens=3)


def test_detokenizing_and_stop_search_stay_incremental():
    """Each cycle decodes a short window and searches only the new text: the work per cycle does not grow with the
    output (a long answer would otherwise slow down token by token)."""

    class Counting(FakeTokenizer):
        def __init__(self):
            self.sizes = []

        def decode(self, ids, skip_special_tokens=True):
            self.sizes.append(len(ids))
            return super().decode(ids)

    tok = Counting()
    gen = Generation(fake_engine(8, 3), [1], tokenizer=tok, max_new_tokens=180, stop_strings=["never here"])
    r = gen.run()
    assert r.generation_tokens == 180 and r.finish_reason == "length"
    assert max(tok.sizes) <= 2 * 8  # a window of at most two cycles' tokens, never the whole output
    assert sum(tok.sizes) <= 4 * 180


class PairTokenizer(FakeTokenizer):
    """Token i decodes to two characters, so a stop string may start inside a token."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.alphabet[i] + self.alphabet[(i * 3 + 1) % V] for i in ids)


def test_text_that_cannot_become_a_stop_string_streams_at_once():
    """Only the longest tail that is the start of a stop string is held back: with a long stop string that never
    begins, each cycle's text goes out in that cycle (holding back len(stop) - 1 characters held it all)."""
    tok = FakeTokenizer()
    ref_text = tok.decode(reference([1], 40))
    stop = "#" * 500  # (never in the alphabet)
    gen = Generation(fake_engine(8, 3), [1], tokenizer=tok, max_new_tokens=40, stop_strings=[stop])
    incs = list(gen)
    assert all(inc.text == tok.decode(inc.tokens) for inc in incs)
    assert "".join(inc.text for inc in incs) == ref_text
    # a stop string whose start the text ends with is held until it is decided
    held = ref_text[11:13] + "#"
    gen = Generation(fake_engine(8, 3), [1], tokenizer=tok, max_new_tokens=40, stop_strings=[held])
    streamed = ""
    for inc in gen:
        streamed += inc.text
        assert not streamed.endswith(held[:2]) or len(streamed) == len(ref_text)
    assert streamed == ref_text


@pytest.mark.parametrize("where", range(0, 30, 3))
def test_logprob_entries_join_to_the_returned_text(where):
    """A stop string may begin inside a token: the entries stop with the token it begins in, spelled as the text it
    kept, so they join to the returned text (streamed as well as whole); a token wholly inside it has none."""
    tok = PairTokenizer()
    text = tok.decode(reference([1, 2, 3], 40))
    stop = text[where + 1:where + 4]
    at = text.index(stop)
    gen = Generation(fake_engine(8, 7), [1, 2, 3], tokenizer=tok, max_new_tokens=40, stop_strings=[stop], logprobs=2)
    incs = list(gen)
    assert "".join(i.text for i in incs) == gen.result.text == text[:at]
    texts = [t for i in incs for t in i.token_texts]
    assert "".join(texts) == text[:at] and len(texts) == (at + 1) // 2
    assert all(len(i.logprobs) == len(i.top_logprobs) == len(i.token_texts) for i in incs)
    assert all(len(top) == 2 for i in incs for top in i.top_logprobs)
    released = ""
    for inc in incs:  # an entry comes out with (never before) the last of its text
        released += "".join(inc.token_texts)
        streamed = "".join(i.text for i in incs[:incs.index(inc) + 1])
        assert streamed.startswith(released)
