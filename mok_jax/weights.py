"""The weights pytree of the MoE layer, in the layout the kernel reads."""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax import export

__all__ = ["MoEWeights"]


class MoEWeights(NamedTuple):
    """Routed and shared expert weights (a pytree; the shared pair may be None).

    gate_up:        [E, H, 2I]  routed gate and up projections: gate = [..., :I], up = [..., I:]
    down:           [E, I, H]   routed down projections
    shared_gate_up: [H, 2Is]    shared expert (all shared experts fused along Is), or None
    shared_down:    [Is, H]     or None

    Under expert parallelism each rank holds its local slice of ``gate_up`` and ``down`` along E
    (rank r holds experts [r*E/ep, (r+1)*E/ep)); the shared expert is replicated.
    """

    gate_up: jax.Array
    down: jax.Array
    shared_gate_up: jax.Array | None = None
    shared_down: jax.Array | None = None

    @property
    def num_local_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.gate_up.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[1]

    @property
    def has_shared(self) -> bool:
        return self.shared_gate_up is not None


# So that a function exported with jax.export may take or return one (its name is part of the serialized form).
export.register_namedtuple_serialization(MoEWeights, serialized_name="mok_jax.MoEWeights")
