"""backends/mlx/ops.py: top_probs, the draft's most probable tokens without a softmax over the vocabulary, is
top_k(softmax(logits)) on every shape the drafter gives it."""

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
from dflash.backends.mlx.ops import MLXOps  # noqa: E402


def _reference(x, k):
    probs = np.asarray(MLXOps.softmax(x, axis=-1))
    ids = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(probs, ids, axis=-1), ids


@pytest.mark.parametrize("shape,k", [((1, 15, 4096), 16), ((4, 15, 4096), 16), ((2, 7, 4000), 16), ((15, 4096), 64),
                                     ((2, 3, 100), 4), ((1, 15, 4096), 1)])
def test_top_probs_is_the_softmaxs_top_k(shape, k):
    rng = np.random.default_rng(k)
    x = mx.array((rng.standard_normal(shape) * 3).astype(np.float32))
    probs, ids = MLXOps.top_probs(x, k)
    want_probs, want_ids = _reference(x, k)
    assert ids.dtype == mx.int32 and ids.shape == want_ids.shape
    np.testing.assert_array_equal(np.asarray(ids), want_ids)  # (continuous draws: no ties)
    np.testing.assert_allclose(np.asarray(probs), want_probs, atol=1e-6, rtol=1e-5)


def test_top_probs_when_the_top_k_share_one_chunk_and_the_rest_is_filtered():
    x = np.full((2, 3, 1000), -np.inf, dtype=np.float32)
    x[:, :, 300:340] = np.linspace(0.0, 4.0, 40, dtype=np.float32)  # every finite logit in one or two chunks
    x[1, 2, 999] = 10.0  # the most probable token in the last (padded) chunk
    probs, ids = MLXOps.top_probs(mx.array(x), 16)
    want_probs, want_ids = _reference(mx.array(x), 16)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(probs), want_probs, atol=1e-6, rtol=1e-5)
    assert not np.isnan(np.asarray(probs)).any()


def test_top_probs_of_bfloat16_logits_keeps_the_probabilities():
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 15, 8192)).astype(np.float32) * 3).astype(mx.bfloat16)
    probs, ids = MLXOps.top_probs(x, 16)
    want_probs, _ = _reference(x, 16)
    # (bfloat16 logits tie often: the tokens may differ among equal logits, the probabilities may not)
    np.testing.assert_allclose(np.asarray(probs), want_probs, atol=1e-6, rtol=1e-5)
    picked = np.take_along_axis(np.asarray(MLXOps.softmax(x, axis=-1)), np.asarray(ids), axis=-1)
    np.testing.assert_allclose(picked, np.asarray(probs), atol=1e-6, rtol=1e-5)
