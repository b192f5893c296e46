"""The single attention entry point used by every model of the recipes.

`attention` builds the `Request` (shapes, dtype, masks) of the call, asks its
`AttentionPlan` which kernel fits (cached per plan and request, so calling it
inside `jit`, `grad` or `remat` costs one lookup per trace and prints nothing),
then calls it; if the kernel still raises `NotImplementedError`, the next
eligible one runs. Under a mesh the caller passes an `AttentionSharding`, and a
kernel XLA cannot partition runs on each device's shard (`sharded`).

Example: the kernel chosen here computes causal softmax attention.
  >>> import jax, jax.numpy as jnp
  >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 4, 2, 8))  # [B, T, N, H] each
  >>> out = attention(q, k, v, causal=True)
  >>> out.shape, out.dtype
  ((1, 4, 2, 8), dtype('float32'))
  >>> logits = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(8.0)
  >>> logits = jnp.where(jnp.tril(jnp.ones((4, 4), bool)), logits, -jnp.inf)
  >>> expected = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)
  >>> bool(jnp.allclose(out, expected, atol=1e-5))
  True
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jax_ai_stack.kernels import implementations, selection, sharded, table
from jax_ai_stack.kernels.plan import AttentionPlan
from jax_ai_stack.kernels.choice import Choice
from jax_ai_stack.kernels.request import Request
from jax_ai_stack.kernels.resolve import resolve_plan


def _check_inputs(q, k, v, segment_ids, kv_seq_lengths) -> None:
  """Shape and dtype errors the kernels would report cryptically, named here."""
  if k.shape != v.shape:
    raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape [B, S, K, H]")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
  if segment_ids is not None:
    if segment_ids.shape != q.shape[:2]:
      raise ValueError(f"segment_ids {segment_ids.shape} must be [B, T] = {q.shape[:2]}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be integers, got {segment_ids.dtype}")
  if kv_seq_lengths is not None:
    if kv_seq_lengths.shape != q.shape[:1]:
      raise ValueError(f"kv_seq_lengths {kv_seq_lengths.shape} must be [B] = {q.shape[:1]}")
    if not jnp.issubdtype(kv_seq_lengths.dtype, jnp.integer):
      raise ValueError(f"kv_seq_lengths must be integers, got {kv_seq_lengths.dtype}")


def _plan(plan: AttentionPlan | None, implementation: str | Sequence[str] | None) -> AttentionPlan:
  if plan is not None and implementation is not None:
    raise ValueError("attention takes a plan or an implementation, not both")
  if plan is not None:
    return plan
  return resolve_plan("auto" if implementation is None else implementation)


def _run(choice: Choice, q, k, v, segment_ids, kv_seq_lengths,
         sharding: sharded.AttentionSharding | None, sinks=None) -> jax.Array:
  """The chosen kernel, or the next eligible one where a kernel refuses (an opaque one on
  each device's shard, `sinks` split with the heads)."""
  refusals = []
  for name, interpret in choice.fallbacks:
    implementation = table.IMPLEMENTATIONS[name]
    run = functools.partial(implementations.call, implementation.run, choice.request,
                            interpret=interpret)
    if not implementation.partitionable:
      run = sharded.per_shard(run, sharding, choice.request, name=name)
    try:
      return run(q, k, v, segment_ids, kv_seq_lengths, sinks=sinks)
    except NotImplementedError as e:
      refusals.append(f"{name}: {e}")
  raise selection.NoImplementationError(
      f"every eligible attention implementation refused {choice.request.describe()}: "
      + "; ".join(refusals)
  )


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    scale: float | None = None,
    local_window: int | None = None,
    logits_soft_cap: float | None = None,
    kv_seq_lengths: jax.Array | None = None,
    sinks: jax.Array | None = None,
    chunk_size: int | None = None,
    plan: AttentionPlan | None = None,
    implementation: str | Sequence[str] | None = None,
    sharding: sharded.AttentionSharding | None = None,
) -> jax.Array:
  """Dot-product attention. q: [B, T, N, H]; k, v: [B, S, K, H] with K dividing N.

  Differentiable, on every implementation. Masks combine (all must allow):

  Args:
    q, k, v: queries, keys, values of one dtype.
    causal: query i sees keys j <= i (top-left aligned, as `jax.nn`). For
      KV-cache decoding pass causal=False and `kv_seq_lengths`.
    segment_ids: [B, T] ints (self-attention only, T == S); tokens attend only
      within their own segment. 0 is an id like any other.
    scale: logits scale, a Python number; default 1 / sqrt(H).
    local_window: w >= 0: query i sees keys i - w .. i.
    logits_soft_cap: c > 0: each scaled logit x becomes c * tanh(x / c).
    kv_seq_lengths: [B] ints; keys at or past that index are ignored.
    sinks: [N], one logit per query head that joins its softmax's denominator and weights
      no value (GPT-OSS's attention sinks); kernels without them are refused by the plan.
    chunk_size: C >= 1: chunked local attention (Llama 4's): query i sees only the keys of
      its chunk, j // C == i // C (with `kv_seq_lengths` L, decoding, the queries sit at
      L - T ... L - 1); kernels without the mask are refused by the plan, with the reason.
    plan: the kernels that may run (models get one passed in). None:
      `resolve_plan()` at this call, i.e. `JAX_AI_STACK_ATTENTION` or "auto";
      a convenience for notebooks.
    implementation: instead of `plan`, `resolve_plan(implementation)`: "auto",
      a name, or a sequence / comma-separated list tried in order.
    sharding: where q, k, v live on a mesh of several devices (the model
      passes one). Kernels that XLA cannot partition then run on each
      device's shard; XLA ones, and every kernel when None, run as they are.

  Returns:
    [B, T, N, H], the dtype of q.

  Raises:
    ValueError: inconsistent shapes or dtypes, an unknown implementation, or
      both `plan` and `implementation`.
    NoImplementationError: no implementation fits; names each reason.
    AttentionShardingError: a kernel runs per shard and the heads do not
      divide by the mesh axes of `sharding.heads`.
  """
  _check_inputs(q, k, v, segment_ids, kv_seq_lengths)
  plan = _plan(plan, implementation)
  request = Request.from_shapes(
      q.shape, k.shape, q.dtype, causal=causal, segment_ids=segment_ids is not None,
      local_window=local_window, kv_seq_lengths=kv_seq_lengths is not None,
      scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks is not None,
      chunk_size=chunk_size,
  )
  if sinks is not None and sinks.shape != (q.shape[2],):
    raise ValueError(f"sinks {sinks.shape} must be [N] = ({q.shape[2]},), one per query head")
  choice = plan.select(request)
  return _run(choice, q, k, v, segment_ids, kv_seq_lengths, sharding, sinks)
