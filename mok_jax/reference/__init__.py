"""Pure-JAX reference of everything the mok kernels compute, written for obviousness, not speed.

It is the correctness oracle of every kernel test and the ``implementation="xla"`` path of the layer.
"""

from mok_jax.reference.backward import experts_backward_ep_reference, experts_backward_reference
from mok_jax.reference.comm import ep_dispatch_combine_identity, ep_dispatch_layout
from mok_jax.reference.experts import grouped_ffn, moe, shared_expert, swiglu_backward, swiglu_ffn
from mok_jax.reference.expert_parallel import ep_moe
from mok_jax.reference.router import route

__all__ = ["ep_dispatch_combine_identity", "ep_dispatch_layout", "ep_moe", "experts_backward_ep_reference",
           "experts_backward_reference", "grouped_ffn", "moe", "route", "shared_expert", "swiglu_backward", "swiglu_ffn"]
