"""mok_jax.ops.grouped_ffn rejects bad arguments at trace time, naming the argument (CPU-runnable)."""

import jax
import jax.numpy as jnp
import pytest

from mok_jax import _native
from mok_jax.ops import grouped_ffn

E, M, H, I = 3, 10, 64, 32


def _args(**over):
    a = dict(x=jnp.ones((M, H), jnp.bfloat16), group_sizes=jnp.array([3, 3, 4], jnp.int32),
             gate_up=jnp.ones((E, H, 2 * I), jnp.bfloat16), down=jnp.ones((E, I, H), jnp.bfloat16))
    a.update(over)
    return a


@pytest.mark.parametrize("over,exc,match", [
    (dict(x=jnp.ones((M, H, 1), jnp.bfloat16)), ValueError, "x must be rank 2"),
    (dict(group_sizes=jnp.ones((E, 1), jnp.int32)), ValueError, "group_sizes must be rank 1"),
    (dict(gate_up=jnp.ones((H, 2 * I), jnp.bfloat16)), ValueError, "gate_up must be rank 3"),
    (dict(down=jnp.ones((I, H), jnp.bfloat16)), ValueError, "down must be rank 3"),
    (dict(x=jnp.ones((M, H), jnp.float32)), TypeError, "x must be bfloat16"),
    (dict(group_sizes=jnp.ones((E,), jnp.float32)), TypeError, "group_sizes must be int32"),
    (dict(gate_up=jnp.ones((E, H, 2 * I), jnp.float32)), TypeError, "gate_up must be bfloat16"),
    (dict(down=jnp.ones((E, I, H), jnp.float16)), TypeError, "down must be bfloat16"),
    (dict(gate_up=jnp.ones((E + 1, H, 2 * I), jnp.bfloat16)), ValueError, "gate_up must be"),
    (dict(gate_up=jnp.ones((E, H + 8, 2 * I), jnp.bfloat16)), ValueError, "gate_up must be"),
    (dict(gate_up=jnp.ones((E, H, 2 * I + 1), jnp.bfloat16)), ValueError, "gate_up must be"),
    (dict(down=jnp.ones((E, I, H + 8), jnp.bfloat16)), ValueError, "down must be"),
    (dict(down=jnp.ones((E, I + 8, H), jnp.bfloat16)), ValueError, "down must be"),
    (dict(x=jnp.ones((M, 60), jnp.bfloat16), gate_up=jnp.ones((E, 60, 2 * I), jnp.bfloat16),
          down=jnp.ones((E, I, 60), jnp.bfloat16)), ValueError, "multiple of 8"),
    (dict(gate_up=jnp.ones((E, H, 2 * 12), jnp.bfloat16), down=jnp.ones((E, 12, H), jnp.bfloat16)),
     ValueError, "multiple of 8"),
    (dict(group_sizes=jnp.ones((1025,), jnp.int32), gate_up=jnp.ones((1025, 8, 16), jnp.bfloat16),
          down=jnp.ones((1025, 8, 8), jnp.bfloat16), x=jnp.ones((M, 8), jnp.bfloat16)), ValueError, "1024"),
])
def test_bad_arguments_raise_naming_the_argument(over, exc, match):
    with pytest.raises(exc, match=match):
        grouped_ffn(**_args(**over))
    with pytest.raises(exc, match=match):  # at trace time under jit too
        jax.jit(lambda a: grouped_ffn(**a))(_args(**over))


@pytest.mark.parametrize("num_sms", [0, -3, True, 2.0, "all"])
def test_bad_num_sms(num_sms):
    with pytest.raises(ValueError, match="num_sms"):
        grouped_ffn(**_args(), num_sms=num_sms)


def test_without_gpu_raises_not_falls_back():
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("this machine has a GPU: the op runs (tests/test_grouped_ffn_gpu.py)")
    with pytest.raises(_native.NativeLibraryUnavailable, match="grouped_ffn"):
        grouped_ffn(**_args())
