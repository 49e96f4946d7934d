"""Speculative sampling is exact: every emitted token is distributed as target-only sampling would draw it.

A tiny target with a 16-token vocabulary: the empirical joint distribution of the first two generated tokens
(the second is the first one a speculative cycle commits) is compared with the exact one, computed by plain target
forwards and transformers' own processors. A wrong acceptance rule (accepting the draft blindly, sampling the
draft, reading the wrong position) fails the same bound by a wide margin.
"""

import numpy as np
import pytest
torch = pytest.importorskip("torch")
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dflash.backends.torch.backend import torch_engine
from dflash.backends.torch.drafter import DFlashDrafter
from dflash.backends.torch.target_runner import TorchTarget
from dflash.core.contract import Draft
from dflash.core.engine import Engine
from dflash.core.errors import DFlashError, SettingError
from dflash.core.loop import generate
from dflash.core.sampling import SamplingParams
from dflash.reference import tiny

V = 16
PROMPT = [3, 1, 4, 1, 5]


class GreedyOracle:
    """A drafter that proposes the target's own greedy continuation of the engine's committed tokens, so proposals
    are accepted often and the acceptance rule is exercised at every block position (a random drafter is almost
    never accepted)."""

    distribution = False
    drafts_some_rows = False

    def __init__(self, model):
        self.model, self.engine, self.memo, self.position = model, None, {}, 0

    def extend(self, pending):
        self.position += pending.counts[0] if pending is not None else 0

    @torch.no_grad()
    def propose(self, anchor_ids, pending, block_size, top_k=0, draws=None, rows=None):
        self.extend(pending)
        ((anchor,),) = anchor_ids.tolist()
        key = tuple(self.engine.tokens + [anchor])
        if key not in self.memo:
            seq = list(key)
            for _ in range(block_size - 1):
                seq.append(int(self.model(torch.tensor([seq])).logits[0, -1].argmax()))
            self.memo[key] = torch.tensor([seq[len(self.engine.tokens):]])
        return Draft(self.memo[key])

    def crop(self, position):
        self.position = position
        return True

    def reset(self):
        self.position = 0


def oracle_engine(model, block_size):
    oracle = GreedyOracle(model)
    oracle.engine = Engine(TorchTarget(model, [0]), oracle, block_size=block_size)
    return oracle.engine


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    d = tmp_path_factory.mktemp("v16")
    model = tiny.build_target(d, vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=64, seed=5, init_std=0.3).eval()
    model.name_or_path = str(d)
    return model


def exact_next(model, prefix, params):
    procs = []
    if params.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        procs.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        procs.append(TopPLogitsWarper(params.top_p))
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[:, -1].float()
    return torch.softmax(LogitsProcessorList(procs)(torch.tensor([prefix]), logits), -1)[0].double()


def chi_square_ok(observed, expected):
    """Pearson chi-square with cells of expectation < 5 pooled; bound ~ 6 sigma above the dof."""
    keep = expected > 5
    chi2 = (((observed[keep] - expected[keep]) ** 2) / expected[keep]).sum()
    rest_o, rest_e = observed[~keep].sum(), expected[~keep].sum()
    if rest_e > 0:
        chi2 += (rest_o - rest_e) ** 2 / rest_e
    dof = int(keep.sum()) + int(rest_e > 0) - 1
    return chi2 < dof + 6 * (2 * dof) ** 0.5, f"chi2 {chi2:.1f} with {dof} dof"


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.7),
], ids=["temperature", "top-k", "top-p"])
def test_first_tokens_match_target_distribution(small_vocab_target, params):
    """Joint distribution of (t1, t2): t1 comes from the prefill, t2 from the first speculative cycle."""
    model = small_vocab_target
    backend = oracle_engine(model, block_size=4)
    n = 600
    observed = torch.zeros(V, V, dtype=torch.float64)
    accepted = 0
    for i in range(n):
        r = generate(backend, PROMPT, max_new_tokens=2, sampling=SamplingParams(**{**params.__dict__, "seed": i}))
        observed[r.tokens[0], r.tokens[1]] += 1
        accepted += r.acceptance_lengths[0] > 1
    assert accepted > n * 0.2  # proposals are accepted often enough for the rule to matter
    p1 = exact_next(model, PROMPT, params)
    joint = torch.stack([p1[t] * exact_next(model, PROMPT + [t], params) if p1[t] > 0 else torch.zeros(V,
                         dtype=torch.float64) for t in range(V)])
    assert observed[joint == 0].sum() == 0, "sampled a pair the processors exclude"
    ok, why = chi_square_ok(observed[joint > 0], joint[joint > 0] * n)
    assert ok, why


def test_blind_acceptance_would_fail(small_vocab_target):
    """The statistic has power: accepting every proposal (a wrong rule) is rejected by the same bound."""
    model = small_vocab_target
    params = SamplingParams(temperature=1.0)
    n = 600
    observed = torch.zeros(V, V, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    p1 = exact_next(model, PROMPT, params)
    for t1 in torch.multinomial(p1, n, replacement=True, generator=gen).tolist():
        with torch.no_grad():
            t2 = int(model(torch.tensor([PROMPT + [t1]])).logits[0, -1].argmax())  # the proposal, taken blindly
        observed[t1, t2] += 1
    joint = torch.stack([p1[t] * exact_next(model, PROMPT + [t], params) for t in range(V)])
    ok, _ = chi_square_ok(observed[joint > 0], joint[joint > 0] * n)
    assert not ok


def test_same_seed_same_tokens(small_vocab_target):
    torch.manual_seed(2)
    drafter = DFlashDrafter(tiny.draft_spec_for(small_vocab_target.name_or_path, num_layers=1, block_size=4,
                                                mask_token_id=V - 1)).eval()
    backend = torch_engine(small_vocab_target, drafter, block_size=4)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123)
    a = generate(backend, PROMPT, max_new_tokens=40, sampling=params).tokens
    b = generate(backend, PROMPT, max_new_tokens=40, sampling=params).tokens
    assert a == b


def test_acceptance_rule():
    from dflash.core.sampling import BLOCK_DEFAULT, DISTRIBUTION_DEFAULT, acceptance_rule

    sampled = SamplingParams(temperature=0.8)
    assert acceptance_rule(SamplingParams(accept="rejection"), True) == "greedy"  # greedy never samples
    assert acceptance_rule(sampled, False) == BLOCK_DEFAULT
    assert acceptance_rule(sampled, True) == DISTRIBUTION_DEFAULT
    assert acceptance_rule(SamplingParams(temperature=0.8, accept="match"), True) == "match"
    assert acceptance_rule(SamplingParams(temperature=0.8, accept="rejection"), False) == "rejection"
    assert acceptance_rule(SamplingParams(temperature=0.8, seed=1), False) == "match"  # a seed's promise
    assert acceptance_rule(sampled, False, trees=True) == "match"
    with pytest.raises(DFlashError, match="--accept"):
        SamplingParams(accept="always").validate()


@pytest.mark.parametrize("params, field, message", [
    (SamplingParams(top_p=1.5), "top_p", "got 1.5, expected a value in (0, 1]"),
    (SamplingParams(presence_penalty=3.0), "presence_penalty", "got 3.0, expected a value in [-2, 2] (0 = off)"),
    (SamplingParams(logit_bias=((7, 1.0), (7, 2.0))), "logit_bias", "token 7 is biased twice"),
])
def test_a_refused_setting_names_its_field_and_reads_as_its_flag(params, field, message):
    with pytest.raises(SettingError) as refused:
        params.validate()
    assert (refused.value.field, refused.value.message) == (field, message)  # what the server answers with
    assert str(refused.value) == f"--{field.replace('_', '-')}: {message}"  # what the CLI prints


def test_noise_is_keyed_by_seed_stream_and_position():
    from dflash.core.sampling import noise_key, uniforms

    assert uniforms(7, "accept", [3, 4]) == uniforms(7, "accept", [3, 4])
    assert uniforms(7, "accept", [3])[0] != uniforms(7, "draft", [3])[0] != uniforms(8, "draft", [3])[0]
    u = np.array(uniforms(1, "residual", range(20_000)))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.003
    assert np.corrcoef(u[:-1], u[1:])[0, 1] ** 2 < 1e-3  # neighbouring positions are independent
    assert len({noise_key(s, "target", p) for s in range(50) for p in range(50)}) == 2500


def test_penalty_fields_take_openais_ranges():
    ok = SamplingParams(presence_penalty=-2, frequency_penalty=2, logit_bias=((9, 0.0), (7, -100), (3, 100.0)))
    assert ok.validate(10).logit_bias == ((3, 100.0), (7, -100.0))  # sorted, zeros dropped
    for bad, match in [(dict(presence_penalty=2.01), "--presence-penalty: got 2.01"),
                       (dict(frequency_penalty=float("nan")), "--frequency-penalty: got nan, expected a finite"),
                       (dict(presence_penalty=True), "--presence-penalty"),
                       (dict(logit_bias=((3, 100.5),)), "--logit-bias: token 3: got 100.5"),
                       (dict(logit_bias=((-1, 1.0),)), "--logit-bias: token id -1"),
                       (dict(logit_bias=((10, 1.0),)), r"token id 10 is outside the vocabulary \(0 .. 9\)"),
                       (dict(logit_bias=((3, 1.0), (3, 2.0))), "token 3 is biased twice")]:
        with pytest.raises(DFlashError, match=match):
            SamplingParams(**bad).validate(10)
