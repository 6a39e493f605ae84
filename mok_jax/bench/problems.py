"""The bench's standard problems: per model, the tokens per GPU and the routed experts per GPU that mok-bench runs
on a GPU when no option says otherwise. The model argument ``bench`` names them all.

- The four models of the Mixture-of-Kittens paper (kimi-k2, glm-5, qwen3.5-397b-a17b, deepseek-v4-pro; tagged
  ``bench`` in configs/models) at 2048 tokens per GPU: on one GPU E/32 experts, the whole 2-GPU ep64-slice problem
  (HARDWARE.md's one-GPU table); on several GPUs the split of --ep-mode (ep64-slice: E/64 each).
- qwen3-30b-a3b, the fine-grained model (I = 768, no shared expert), at 8192 tokens per GPU with 16 of its 128
  experts per GPU, on one GPU as on several (at EP 8 the whole model; its E/64 = 2 experts per GPU would leave a
  token fewer than its k = 8 experts to pick on fewer than 4 GPUs).

--tokens, --experts-per-gpu and --ep-mode override a model's standard problem (for every model named). On CPU
mok-bench runs its own small defaults (options.CPU_DEFAULTS): the standard problems are GPU problems.
A table here, not fields of the model files: a model's shape is what the model is (mok_jax.config.ModelShape), its
standard problem is what this bench measures of it.
"""

from __future__ import annotations

import dataclasses

from mok_jax.bench import accounting as acc

__all__ = ["STANDARD_PROBLEMS", "STANDARD_SET", "StandardProblem", "standard_models"]

STANDARD_SET = "bench"  # the model argument that names every model of STANDARD_PROBLEMS


@dataclasses.dataclass(frozen=True, kw_only=True)
class StandardProblem:
    """tokens_per_gpu: T; one_gpu_experts: --experts-per-gpu on one GPU ('N' or 'E/d'); several_gpus_experts: the
    same on several GPUs, None for the split of --ep-mode."""

    tokens_per_gpu: int
    one_gpu_experts: str
    several_gpus_experts: str | None = None

    def __post_init__(self):
        if not (isinstance(self.tokens_per_gpu, int) and self.tokens_per_gpu > 0):
            raise ValueError(f"tokens_per_gpu must be a positive int, got {self.tokens_per_gpu!r}")
        object.__setattr__(self, "one_gpu_experts", acc.parse_experts_per_gpu(self.one_gpu_experts))
        if self.several_gpus_experts is not None:
            object.__setattr__(self, "several_gpus_experts", acc.parse_experts_per_gpu(self.several_gpus_experts))

    def experts_per_gpu(self, num_gpus: int) -> str | None:
        """The --experts-per-gpu of this problem on ``num_gpus`` GPUs (None: the split of --ep-mode)."""
        return self.one_gpu_experts if num_gpus == 1 else self.several_gpus_experts


_PAPER = StandardProblem(tokens_per_gpu=2048, one_gpu_experts="E/32")
STANDARD_PROBLEMS: dict[str, StandardProblem] = {
    "kimi-k2": _PAPER,
    "glm-5": _PAPER,
    "qwen3.5-397b-a17b": _PAPER,
    "deepseek-v4-pro": _PAPER,
    "qwen3-30b-a3b": StandardProblem(tokens_per_gpu=8192, one_gpu_experts="16", several_gpus_experts="16"),
}


def standard_models() -> list[str]:
    """The model names ``bench`` stands for, in the table's order."""
    return list(STANDARD_PROBLEMS)
