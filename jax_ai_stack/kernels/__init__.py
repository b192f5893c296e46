"""Attention kernels chosen per backend. `attention` is the one entry point."""

from jax_ai_stack.kernels.attention import attention

__all__ = ["attention"]
