"""Sampling settings, per-row sampling state, the acceptance rules and the noise they draw with, backend-neutral.

Rules (a row's `RowSampling.rule`, chosen when it is admitted; ../docs/sampling.md has the measurements):
- greedy: the target's argmax at every verified position; a drafted token is kept while it equals it.
- match (coupled sample-and-match): the target draws its token at position n as argmax(scores_n + G_n), an exact
  sample by the Gumbel-max trick, with G_n Gumbel noise keyed by (seed, n). A DFlash draft proposes
  argmax(draft scores_n + G_n) with the same noise, so it equals the target's draw whenever the two distributions
  agree (and often when they differ). Every emitted token is the target's own draw: the output is target-only
  sampling with that seed, whatever was drafted, verified, batched or budgeted. Trees rank each depth's candidates
  by the same perturbed score.
- rejection: the draft samples x_i ~ q_i (its per-position distribution at the row's temperature and filters,
  on its 64 likeliest tokens; DFlash2: the selector's q), the target keeps x_i with probability min(1, p/q) and at
  the first rejection draws from max(0, p - q) normalised; a full block draws the bonus from p. Acceptance per
  position is 1 - TV(p_i, q_i). DFlash's q_i does not condition on the earlier draft tokens, which the proof does not
  need: x_i is drawn from the q_i the ratio uses, given everything before.
- argmax / sharpened: rejection against another proposal shape, the draft temperature t (dflash.core.shapes):
  q_t proportional to q^(1/t), drafted from q_t and verified against q_t; t = 0 is the one-hot q at argmax q, kept
  with probability p(x), the residual p with x removed. shaped: each cycle's t
  chosen per row from the acceptance its earlier cycles saw.
- multi (trees): a node's children, one-hot proposals tried in order, child c_j kept with probability p'(c_j),
  p' = p with the children before it removed, renormalised; no child kept: a draw from p with all of them removed
  (recursive rejection sampling, SpecInfer). A chain cycle of a multi row verifies like argmax.
The draft draw, the acceptance test and the residual draw use noise streams of their own (a shared one biases the
output), keyed by position like the target's.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal, Sequence, get_args

from .errors import SettingError
from .shapes import MATCH_SHAPES, SHAPES, ShapeChoice


# vLLM's conventions: a temperature below this is greedy (dividing logits by 1e-38 overflows to inf and the softmax to
# nan); top_k -1 is "off" like 0. The repetition penalty divides (or multiplies) logits by itself, so it is kept
# within a range that cannot overflow float16/32 logits. The presence and frequency penalties and the logit bias take
# OpenAI's ranges.
SAMPLING_EPS = 1e-5
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PRESENCE_PENALTY_RANGE = FREQUENCY_PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # divides a seen token's positive logit, multiplies a negative one
    # OpenAI's: subtracted from the logit of every token the output holds so far (presence), once per occurrence
    # (frequency); the prompt is not counted (vLLM's reading), unlike the repetition penalty's
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
    seed: int | None = None
    accept: str = "auto"  # the acceptance rule when sampling: one of ACCEPT_RULES (acceptance_rule)
    draft_temperature: float = 0.5  # accept="sharpened": the drafts come from q^(1/t) renormalised

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def output_penalties(self) -> bool:
        """The presence or the frequency penalty is on (their counts are over the output only)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @cached_property
    def processors(self) -> bool:
        """A logits processor is on (the logit bias, the repetition, presence or frequency penalty): a batch of
        greedy rows without one is drawn by one argmax. (Cached: a target reads it for every row every cycle.)"""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or self.output_penalties

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Refuse what no sampler can use (logit_bias ids outside 0 .. vocab_size - 1 when it is given); returns the
        settings normalised (a temperature below SAMPLING_EPS is greedy: 0; top_k -1 is off: 0; logit_bias sorted,
        zero biases dropped)."""
        def bad(field: str, value, expected: str):
            raise SettingError(field, f"got {value!r}, expected {expected}")

        for field, value in (("temperature", self.temperature), ("top_p", self.top_p), ("min_p", self.min_p),
                             ("repetition_penalty", self.repetition_penalty),
                             ("presence_penalty", self.presence_penalty),
                             ("frequency_penalty", self.frequency_penalty)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(field, value, "a finite number")
        if self.temperature < 0:
            bad("temperature", self.temperature, ">= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "a value in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "a value in [0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", self.top_k, ">= 0 (0 or -1 = off)")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            bad("repetition_penalty", self.repetition_penalty, f"a value in [{low:g}, {high:g}] (1 = off)")
        for field, value, (low, high) in (("presence_penalty", self.presence_penalty, PRESENCE_PENALTY_RANGE),
                                          ("frequency_penalty", self.frequency_penalty, FREQUENCY_PENALTY_RANGE)):
            if not low <= value <= high:
                bad(field, value, f"a value in [{low:g}, {high:g}] (0 = off)")
        bias = _checked_bias(self.logit_bias, vocab_size)
        if self.seed is not None and self.seed < 0:
            bad("seed", self.seed, ">= 0")
        if self.accept not in ACCEPT_RULES:
            bad("accept", self.accept, " or ".join(repr(r) for r in ACCEPT_RULES))
        if not isinstance(self.draft_temperature, (int, float)) or not 0 < self.draft_temperature <= 1:
            bad("draft_temperature", self.draft_temperature, "a value in (0, 1] (1: q itself)")
        if self.temperature < SAMPLING_EPS and self.temperature != 0.0 or self.top_k == -1 or bias != self.logit_bias:
            return replace(self, temperature=0.0 if self.temperature < SAMPLING_EPS else self.temperature,
                           top_k=max(self.top_k, 0), logit_bias=bias)
        return self


def _checked_bias(pairs, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs without zeros; one line for the first bad pair."""
    low, high = LOGIT_BIAS_RANGE
    out = {}
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise SettingError("logit_bias", f"got {pair!r}, expected (token id, bias) pairs")
        token, value = pair
        if isinstance(token, bool) or not isinstance(token, int) or token < 0 or \
                vocab_size is not None and token >= vocab_size:
            span = f"0 .. {vocab_size - 1}" if vocab_size is not None else ">= 0"
            raise SettingError("logit_bias", f"token id {token!r} is outside the vocabulary ({span})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise SettingError("logit_bias", f"token {token}: got {value!r}, expected a bias in [{low:g}, {high:g}]")
        if token in out:
            raise SettingError("logit_bias", f"token {token} is biased twice")
        if value:
            out[token] = float(value)
    return tuple(sorted(out.items()))


AcceptRule = Literal["auto", "match", "rejection", "argmax", "sharpened", "shaped", "multi"]
ACCEPT_RULES: tuple[str, ...] = get_args(AcceptRule)
# What "auto" picks when sampling, per drafter kind: rejection accepted more than coupled match for DFlash2's
# selector (docs/dflash2.md) and for DFlash blocks; no other proposal shape (argmax, sharpened, shaped) accepted
# more than q on the bundled pair at 0.3 / 0.7 / 1.0, and shaped accepted less at 0.3 (docs/sampling.md); a seeded DFlash request (or one verified by trees) matches instead, since its output must not
# depend on the budget, and chooses its draft's shape the same way (match's output never depends on the draft).
DISTRIBUTION_DEFAULT = "rejection"
BLOCK_DEFAULT = "rejection"
# the rules that verify a chain by rejection against the draft's q (Draft.q_ids / q_probs), and those of them
# that never verify a tree
REJECTION_RULES = frozenset({"rejection", "argmax", "sharpened", "shaped", "multi"})
CHAIN_ONLY_RULES = REJECTION_RULES - {"multi"}


def acceptance_rule(params: SamplingParams, has_distribution: bool, trees: bool = False) -> str:
    """"greedy" (argmax and equality), "match" (sample-and-match against a proposal drawn with the target's own
    noise), "rejection" / "argmax" / "sharpened" / "shaped" (exact rejection sampling against the draft's q, q's
    argmax, q sharpened, or the shape the row's cycles accept best) or "multi" (trees: several one-hot children per
    node). trees: every cycle verifies a tree (--verify tree), which auto then matches (rejection verifies chains);
    multi without trees is argmax (a chain is a tree of one child per node)."""
    if params.greedy:
        return "greedy"
    if params.accept == "auto":
        if has_distribution:
            return DISTRIBUTION_DEFAULT
        # a seed promises the same tokens whatever the verify budget chose, which only match's output keeps
        return "match" if trees or params.seed is not None else BLOCK_DEFAULT
    if params.accept == "multi" and not trees:
        return "argmax"
    return params.accept


# ---- noise tied to positions ----------------------------------------------------------------------------------------
# Every random draw of a row is keyed by (the row's seed, the stream, the absolute position of the token it decides),
# never by how many draws came before: the same seeded request then gives the same tokens whatever the verify mode,
# the budget, the batch or the cycle boundaries were. Streams are independent (a shared one biases rejection
# sampling): the target's draw (Gumbel noise over the vocabulary), the draft's draw, the acceptance test and the
# residual's draw (one uniform each), a cycle's choice of proposal shape, and a tree node's tests of its children.
NOISE_STREAMS = {"target": 1, "draft": 2, "accept": 3, "residual": 4, "explore": 5, "children": 6}
_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_key(seed: int, stream: str, position: int) -> int:
    """The 63-bit key of one draw (a generator seed for vector noise)."""
    return _mix(_mix(_mix(seed & _MASK64) ^ NOISE_STREAMS[stream]) ^ position) >> 1


def uniforms(seed: int, stream: str, positions) -> list[float]:
    """One uniform in (0, 1) per position, from its key alone."""
    return [_uniform(noise_key(seed, stream, p)) for p in positions]


def uniform_rows(seed: int, stream: str, positions, width: int) -> list[list[float]]:
    """`width` uniforms per position (a tree node's children, tried in order), each from (key, index) alone."""
    return [[_uniform(_mix(noise_key(seed, stream, p) ^ j) >> 1) for j in range(width)] for p in positions]


def _uniform(key: int) -> float:
    return ((key >> 10) + 0.5) / 2.0 ** 53


def draft_temperatures(rule: str, sharpened: float, auto: bool) -> tuple[float, ...]:
    """The draft temperatures a row of this rule chooses from (one: fixed); sharpened: the request's
    (SamplingParams.draft_temperature). auto: the request left the rule to dflash (--accept auto), so a matched row
    may choose its shape too."""
    if rule in ("argmax", "multi"):
        return (0.0,)
    if rule == "sharpened":
        return (float(sharpened),)
    if rule == "shaped":
        return SHAPES
    if rule == "match" and auto:
        return MATCH_SHAPES
    return (1.0,)


@dataclass(frozen=True)
class RowSampling:
    """What one row samples with, fixed when it is admitted: its settings, its acceptance rule, its noise seed
    (the request's, or one drawn at admission), where its output starts, and the proposal shapes its draft chooses
    from (dflash.core.shapes; the chooser's estimates are the one thing that changes, from the row's past cycles)."""

    params: SamplingParams
    rule: str
    seed: int
    prompt_tokens: int = 0  # the row's cached tokens before its output (what presence/frequency penalties skip)
    shapes: ShapeChoice = field(default_factory=lambda: ShapeChoice((1.0,)), compare=False)

    @classmethod
    def admit(cls, params: SamplingParams, has_distribution: bool = False, trees: bool = False,
              prompt_tokens: int = 0) -> "RowSampling":
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        rule = acceptance_rule(params, has_distribution, trees)
        auto = params.accept == "auto" and not has_distribution
        shapes = ShapeChoice(draft_temperatures(rule, params.draft_temperature, auto))
        return cls(params, rule, seed, prompt_tokens, shapes)

    @property
    def greedy(self) -> bool:
        return self.rule == "greedy"

    @property
    def rejects(self) -> bool:
        """A chain cycle verifies the draft's q by rejection (Draft.q_ids / q_probs)."""
        return self.rule in REJECTION_RULES

    @property
    def chains_only(self) -> bool:
        return self.rule in CHAIN_ONLY_RULES

    def gumbel_keys(self, positions) -> list[int]:
        return [noise_key(self.seed, "target", p) for p in positions]


@dataclass
class RowDraw:
    """One row's draws for one cycle, as the drafter and the target's sampler read them: `gumbel` (positions, V) is
    the target's noise at the cycle's positions (None: greedy); `draft_u` / `accept_u` / `residual_u` the
    uniforms of the other streams (rejection rows)."""

    sampling: RowSampling
    position: int = 0  # the first position the cycle decides
    gumbel: Any = None  # (a device array)
    draft_u: list[float] | None = None
    accept_u: list[float] | None = None
    residual_u: list[float] | None = None
    draft_temperature: float = 1.0  # the cycle's proposal shape (0: argmax; dflash.core.shapes)
    # multi rows in a tree cycle (set by the tree step): per node its children (nodes, m) tried in order, how many
    # are real (the rest repeat the first), and a uniform per (node, child)
    children: list[list[int]] | None = None
    counted: list[list[float]] | None = None
    child_u: list[list[float]] | None = None

    @property
    def rule(self) -> str:
        return self.sampling.rule

    @property
    def rejects(self) -> bool:
        return self.sampling.rejects

    @property
    def params(self) -> SamplingParams:
        return self.sampling.params


# The log-probability reported for a token the request's filters (top-k, top-p, min-p) exclude, as OpenAI reports
# one: -inf is not JSON, and a finite floor keeps "this token could not be drawn" plain to a client.
EXCLUDED_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    """A reported log-probability: EXCLUDED_LOGPROB for an excluded token (-inf, or NaN from an all-excluded row)."""
    return value if value > EXCLUDED_LOGPROB else EXCLUDED_LOGPROB


def host_logprobs(chosen: list[list[float]], top_ids: list[list[list[int]]], top_lps: list[list[list[float]]]):
    """Per row and position, the chosen token's log-probability and its top (id, log-probability) pairs, as
    reported (finite_logprob), from the host lists of Target.sample's log-prob arrays."""
    return ([[finite_logprob(v) for v in row] for row in chosen],
            [[[(i, finite_logprob(v)) for i, v in zip(pi, pv)] for pi, pv in zip(ri, rv)]
             for ri, rv in zip(top_ids, top_lps)])


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def accepted_length(drafted: list[int], target: list[int]) -> int:
    """Number of leading drafted tokens equal to the target's tokens at the same positions.

    drafted[i] is the proposal for the position the target fills with target[i]; len(target) == len(drafted) + 1,
    the extra target token being the bonus committed after the accepted prefix.
    """
    return common_prefix(drafted, target)


def row_draws(rows: Sequence[Sequence[int]], samplings: Sequence[RowSampling], gumbel, width: int, offset: int = 1,
              noise: int | None = None) -> list[RowDraw] | None:
    """Each row's noise for a cycle that decides the tokens at positions n + offset .. n + offset + width - 1
    (n: the row's cached length, its anchor's position), Gumbel noise for the first `noise` of them (default:
    all); None when every row is greedy."""
    if all(r.greedy for r in samplings):
        return None
    draws = []
    for row, sampling in zip(rows, samplings):
        positions = range(len(row) + offset, len(row) + offset + width)
        draw = RowDraw(sampling, positions.start)
        if not sampling.greedy:
            draw.gumbel = gumbel(sampling.gumbel_keys(positions[:noise]))
            draw.draft_temperature = sampling.shapes.choose(uniforms(sampling.seed, "explore", [positions.start])[0])
        if sampling.rejects:
            draw.draft_u, draw.accept_u, draw.residual_u = (uniforms(sampling.seed, stream, positions)
                                                            for stream in ("draft", "accept", "residual"))
        draws.append(draw)
    return draws
