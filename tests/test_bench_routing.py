"""mok-bench routing generators: distinct experts per token, balance, skew, determinism."""

import numpy as np
import pytest

from mok_jax.bench.routing import make_routing


def _distinct(idx):
    s = np.sort(idx, axis=1)
    return bool(np.all(s[:, 1:] != s[:, :-1]))


def _check_weights(w):
    assert w.dtype == np.float32 and np.all(w > 0)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("ranks,tokens,experts,k", [(2, 2048, 12, 8), (2, 100, 16, 10), (8, 33, 16, 4),
                                                     (2, 64, 8, 8), (1, 7, 5, 1)])
def test_uniform_is_balanced_per_rank_and_expert(ranks, tokens, experts, k):
    idx, w = make_routing("uniform", num_ranks=ranks, tokens_per_rank=tokens, num_experts=experts, top_k=k, seed=3)
    assert idx.shape == (ranks * tokens, k) and idx.dtype == np.int32
    assert _distinct(idx) and idx.min() >= 0 and idx.max() < experts
    _check_weights(w)
    for r in range(ranks):
        counts = np.bincount(idx[r * tokens:(r + 1) * tokens].ravel(), minlength=experts)
        assert counts.max() - counts.min() <= 1, counts  # T*k/E each, give or take one


def test_uniform_covers_all_experts_when_k_equals_e():
    idx, _ = make_routing("uniform", num_ranks=2, tokens_per_rank=16, num_experts=8, top_k=8)
    np.testing.assert_array_equal(np.sort(idx, axis=1), np.tile(np.arange(8), (32, 1)))


def test_zipf_is_skewed_and_distinct():
    idx, w = make_routing("zipf", num_ranks=2, tokens_per_rank=1024, num_experts=64, top_k=4, zipf_s=1.2, seed=1)
    assert _distinct(idx)
    _check_weights(w)
    counts = np.bincount(idx.ravel(), minlength=64)
    assert counts.max() > 4 * counts.mean()  # p_1 / mean(p) is ~10 at s = 1.2, E = 64 before saturation
    flat, _ = make_routing("zipf", num_ranks=2, tokens_per_rank=1024, num_experts=64, top_k=4, zipf_s=0.0, seed=1)
    c0 = np.bincount(flat.ravel(), minlength=64)
    assert c0.max() < 1.5 * c0.mean()  # s = 0 is uniform in distribution


def test_one_expert():
    idx, w = make_routing("one-expert", num_ranks=2, tokens_per_rank=5, num_experts=16, top_k=4)
    np.testing.assert_array_equal(idx, np.tile(np.arange(4), (10, 1)))
    _check_weights(w)


def test_seeded():
    a = make_routing("zipf", num_ranks=2, tokens_per_rank=64, num_experts=16, top_k=4, seed=5)
    b = make_routing("zipf", num_ranks=2, tokens_per_rank=64, num_experts=16, top_k=4, seed=5)
    c = make_routing("zipf", num_ranks=2, tokens_per_rank=64, num_experts=16, top_k=4, seed=6)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


def test_errors():
    with pytest.raises(ValueError, match="must not exceed"):
        make_routing("uniform", num_ranks=1, tokens_per_rank=4, num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="routing must be one of"):
        make_routing("round-robin", num_ranks=1, tokens_per_rank=4, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="tokens_per_rank"):
        make_routing("uniform", num_ranks=1, tokens_per_rank=0, num_experts=4, top_k=2)
