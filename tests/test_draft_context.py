"""The framework-neutral draft-attention rule and the draft cache's slot layout (dflash/core/draft_context.py)."""

import numpy as np
import pytest

from dflash.core.draft_context import ContextLayout, LayerRule, draft_visible


def reference_visible(q, k, anchor, block, window, sliding, causal):
    """The rule spelled out position by position."""
    if k >= anchor + block or k < 0:
        return False
    if k < anchor:  # context
        if window is not None and k < anchor - window:
            return False
    elif causal and k > q:  # inside the block
        return False
    if sliding is not None and (q - k >= sliding or (not causal and k - q >= sliding)):
        return False
    return True


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("sliding,causal", [(None, False), (None, True), (4, True), (4, False), (9, True)])
def test_predicate_equals_the_rule_spelled_out(window, sliding, causal):
    anchor, block = 11, 6
    q = anchor + np.arange(block)[:, None]
    k = np.arange(anchor + block + 3)[None, :]
    got = draft_visible(q, k, anchor, block, window=window, sliding=sliding, causal=causal)
    want = np.array([[reference_visible(int(a), int(b), anchor, block, window, sliding, causal) for b in k[0]]
                     for a in q[:, 0]])
    assert got.shape == want.shape and (got == want).all()


def test_predicate_broadcasts_per_row():
    anchors = np.array([3, 7])[:, None, None]
    q = anchors + np.arange(4)[:, None]
    got = draft_visible(q, np.arange(12)[None, None], anchors, 4)
    assert got.shape == (2, 4, 12)
    assert got[0, :, :7].all() and not got[0, :, 7:].any()  # row 0 sees its context and its own block only
    assert got[1, :, :11].all() and not got[1, :, 11:].any()


def test_layout_grows_by_doubling_and_recycles_under_a_window():
    grow = ContextLayout(capacity=8)
    grow.lengths = [6]
    assert grow.plan_reserve(4) == (0, 16)
    windowed = ContextLayout(capacity=8, window=3)
    windowed.lengths = [7]
    shift, capacity = windowed.plan_reserve(4)
    assert (shift, capacity) == (4, 8)  # keep the last 3 entries, at the front
    windowed.apply_reserve(shift, capacity)
    assert windowed.slot(7) == 3 and not windowed.crop(0, 3) and windowed.crop(0, 5)


def test_span_reads_only_what_some_row_can_see():
    layout = ContextLayout(capacity=64)
    layout.lengths = [20, 30]
    assert layout.span(LayerRule(None, False), [20, 30], 4) == (0, 34)
    assert layout.span(LayerRule(5, True), [22, 30], 4) == (18, 34)  # the nearest anchor's sliding reach
    windowed = ContextLayout(capacity=64, window=8)
    windowed.lengths = [20]
    assert windowed.span(LayerRule(None, False), [20], 4) == (12, 24)
