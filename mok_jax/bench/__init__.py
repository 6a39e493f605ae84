"""mok-bench: how fast the MoE layer runs on this machine, against what a JAX user would use instead."""
