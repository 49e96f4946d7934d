"""The rules written once in dflash/core/rules.py give the same numbers on both backends, side by side: the sampling
filters in one order (the temperature first, as transformers), the rejection rule with its residual draw,
multi-candidate rejection at tree nodes, the inverse-CDF draw and the drafter's logit scaling."""

from types import SimpleNamespace

import numpy as np
import pytest
torch = pytest.importorskip("torch")

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from dflash.backends.mlx import drafter as mlx_drafter  # noqa: E402
from dflash.backends.mlx import sampling as mlx_sampling  # noqa: E402
from dflash.backends.torch import drafter as torch_drafter  # noqa: E402
from dflash.backends.torch import sampling as torch_sampling  # noqa: E402
from dflash.core.sampling import SamplingParams  # noqa: E402

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=0.6, top_p=0.8),
    SamplingParams(temperature=1.4, min_p=0.1),
    SamplingParams(temperature=0.5, top_k=12, top_p=0.9, min_p=0.02),
], ids=["top-k", "top-p", "min-p", "all"])
def test_both_backends_draw_from_the_same_distribution(params):
    logits = (RNG.standard_normal((6, 40)) * 3).astype(np.float32)
    ours = torch.softmax(torch_sampling.TorchSampler(params).scores(torch.tensor(logits), [], None), dim=-1)
    theirs = mlx_sampling.MLXSampler(params).probabilities(mx.array(logits))
    np.testing.assert_allclose(np.array(theirs), ours.numpy(), atol=1e-5)


def test_the_rejection_rule_and_its_draws_agree():
    b, v, k = 6, 20, 4
    p = RNG.dirichlet(np.ones(v), size=b).astype(np.float32)
    q_ids = np.stack([RNG.choice(v, k, replace=False) for _ in range(b - 1)])
    q_probs = RNG.dirichlet(np.ones(k), size=b - 1).astype(np.float32)
    drafted = q_ids[np.arange(b - 1), RNG.integers(0, k, b - 1)]
    accept_u, residual_u = RNG.random(b - 1).astype(np.float32), RNG.random(b - 1).astype(np.float32)
    args = (p, drafted, q_ids, q_probs, accept_u, residual_u, np.array(3))
    ours = torch_sampling.rejection_tokens(*(torch.tensor(a) for a in args))
    theirs = mlx_sampling.rejection_tokens(*(mx.array(a) for a in args))
    assert ours.tolist() == np.array(theirs).tolist()
    u = RNG.random(b).astype(np.float32)
    assert (torch_sampling.inverse_cdf(torch.tensor(p), torch.tensor(u)).tolist()
            == np.array(mlx_sampling.inverse_cdf(mx.array(p), mx.array(u))).tolist())


def test_multi_candidate_rejection_agrees():
    """Nodes with three children, one child, none (a leaf) and children that cover all of p's mass."""
    v = 12
    p = RNG.dirichlet(np.ones(v), size=4).astype(np.float32)
    p[3] = 0
    p[3, [2, 5]] = [0.25, 0.75]
    children = np.array([[4, 1, 7], [3, 3, 3], [0, 0, 0], [2, 5, 2]])
    counted = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]], dtype=np.float32)
    for _ in range(20):
        draw = SimpleNamespace(children=children, counted=counted, child_u=RNG.random((4, 3)),
                               residual_u=RNG.random(4))
        ours = torch_sampling.multi_candidate_tokens(torch.tensor(p), draw).tolist()
        theirs = np.array(mlx_sampling.multi_candidate_tokens(mx.array(p), draw)).tolist()
        assert ours == theirs and ours[3] in (2, 5)  # (the last node's children hold all of p)


@pytest.mark.parametrize("multiplier,cap", [(1.0, None), (2.0, None), (0.5, 30.0)])
def test_logit_scaling_agrees(multiplier, cap):
    logits = (RNG.standard_normal((3, 50)) * 40).astype(np.float32)
    ours = torch_drafter.scale_logits(torch.tensor(logits), multiplier, cap)
    theirs = mlx_drafter.scale_logits(mx.array(logits), multiplier, cap)
    np.testing.assert_allclose(np.array(theirs), ours.numpy(), rtol=1e-5, atol=1e-4)
