"""Seeded routing generators for the benchmark: which experts each token picks, and with what weight.

Every generator returns ``topk_idx: int32[R*T, k]`` (global expert ids, k distinct per token, as the
layer requires) and ``topk_weight: f32[R*T, k]`` (positive, each row sums to 1) for R ranks of T
tokens each; rank r holds rows [r*T, (r+1)*T). Numpy on the host, so a seed gives the same routing on
every machine.

- ``uniform``: exactly balanced as far as integers allow. The tokens of each rank are cut into blocks
  of E tokens; in a block with its own random expert permutation ``perm``, token i picks
  ``perm[(i*k + j) mod E]`` for j < k. The block's E*k picks are E*k consecutive integers mod E, so
  every expert is picked exactly k times per block, and a token's k picks are distinct (k <= E).
  A final partial block of m tokens picks m*k consecutive integers: each expert floor or ceil of
  m*k/E times. So every (source rank, expert) pair carries T*k/E picks, give or take one, and each
  token's set is a uniformly random k-subset (for one token, ``perm`` is uniform).
- ``zipf``: expert popularity p_e proportional to 1/rank_e**s, with the popularity ranks assigned to
  experts by a random permutation (so hot experts land on random EP ranks); each token draws k
  distinct experts without replacement in proportion to p (Gumbel top-k).
- ``one-expert``: every token picks experts 0..k-1, the same set: expert 0 (and each of the others)
  receives every token, and the whole load lands on the rank(s) owning the lowest ids. The layer
  needs k distinct experts per token, so "all tokens to one expert" means this for k > 1.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ROUTINGS", "make_routing"]

ROUTINGS = ("uniform", "zipf", "one-expert")


def _uniform(rng: np.random.Generator, num_ranks: int, tokens: int, num_experts: int, top_k: int) -> np.ndarray:
    blocks = -(-tokens // num_experts)  # per rank
    perms = rng.permuted(np.tile(np.arange(num_experts, dtype=np.int32), (num_ranks, blocks, 1)), axis=-1)
    t = np.arange(tokens)
    block, i = t // num_experts, t % num_experts
    pos = (i[:, None] * top_k + np.arange(top_k)[None, :]) % num_experts  # [T, k]
    return perms[:, block[:, None], pos].reshape(num_ranks * tokens, top_k)  # perms[r, block_t, pos_tj]


def _zipf(rng: np.random.Generator, n: int, num_experts: int, top_k: int, s: float) -> np.ndarray:
    popularity_rank = rng.permutation(num_experts)
    log_p = -s * np.log1p(popularity_rank.astype(np.float64))
    scores = log_p[None, :] + rng.gumbel(size=(n, num_experts))
    top = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
    order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1)  # strongest choice first
    return np.take_along_axis(top, order, axis=1)


def make_routing(
    kind: str,
    *,
    num_ranks: int,
    tokens_per_rank: int,
    num_experts: int,
    top_k: int,
    seed: int = 0,
    zipf_s: float = 1.2,
) -> tuple[np.ndarray, np.ndarray]:
    """(topk_idx int32[R*T, k], topk_weight f32[R*T, k]) for routing ``kind`` (one of ROUTINGS)."""
    if kind not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {kind!r}")
    for name, v in (("num_ranks", num_ranks), ("tokens_per_rank", tokens_per_rank), ("num_experts", num_experts),
                    ("top_k", top_k)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k ({top_k}) must not exceed the number of experts ({num_experts}): each token "
                         "picks k distinct experts")
    if kind == "zipf" and not zipf_s >= 0:
        raise ValueError(f"the zipf exponent must be >= 0, got {zipf_s}")
    rng = np.random.default_rng(seed)
    n = num_ranks * tokens_per_rank
    if kind == "uniform":
        idx = _uniform(rng, num_ranks, tokens_per_rank, num_experts, top_k)
    elif kind == "zipf":
        idx = _zipf(rng, n, num_experts, top_k, zipf_s)
    else:
        idx = np.tile(np.arange(top_k), (n, 1))
    logits = rng.standard_normal((n, top_k))
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return idx.astype(np.int32), w.astype(np.float32)
