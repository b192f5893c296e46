"""A Llama-style decoder LM in Flax NNX, with a KV cache for decoding.

Token embedding -> `num_layers` x [RMSNorm -> grouped-query attention with RoPE
-> residual; RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> output head (its
own matrix, or the embedding transposed when `tie_embeddings`).

Attention goes through `jax_ai_stack.kernels.attention`, so the choice of kernel
(XLA, cuDNN, Pallas, ...) lives in one place. Which kernels may run is an
explicit `kernels.AttentionPlan` given to the model (the trainer resolves one
per run from the config, the environment and an autotune file, through
`kernels.plan_for_run`); without one, the plan is `config.attention_impl` alone:
the model reads no environment. RoPE (with Llama 3.1's frequency scaling when
`config.rope_scaling` is set) lives in `rope`.

Logical axis names, one per parameter dimension (via `nnx.with_partitioning`),
for the sharding recipe to map onto mesh axes:

  vocab     vocabulary rows of the embedding and columns of the output head
            (`config.padded_vocab_size` of them; the logits keep vocab_size)
  embed     the model (residual stream) dimension, d_model
  heads     query heads
  kv_heads  key/value heads (fewer than `heads` with grouped-query attention)
  head_dim  features per head
  mlp       hidden units of the SwiGLU MLP
  norm      features scaled by an RMSNorm
  layers    the leading axis of the stacked blocks when `scan_layers` (no mesh
            axis maps to it: every device holds every layer's share)

With `config.scan_layers` the blocks are one `Block` whose parameters are
stacked [num_layers, ...] (built with `nnx.vmap`) and run by `nnx.scan`: XLA
compiles one block instead of `num_layers`, so compile time stays flat in depth.
The KV cache is then stacked too (keys [num_layers, B, S, K, H]).
`layer_stack.convert` moves the weights between the two layouts.

Under a mesh of several devices the trainer also gives the model a
`sharding.Layout` (its mesh and logical rules): the hidden states [B, T, D] are
pinned after the embedding and on each attention and MLP output (batch as the
rules' "batch", D replicated), so that XLA does not guess, and attention learns
where q, k, v live, so that a kernel XLA cannot partition runs per shard
(`kernels.sharded`). Without a layout (one device) none of this is traced.

Parameter paths keep to names that a weight-decay mask can match: the token
embedding sits under `embed`, norms are attributes whose names contain `norm`
(their parameter is `scale`), and there are no biases.

Beside the model: `decoding.generate` samples with the KV cache (the
generation engine, `recipes.inference`, decodes many requests at once) and
`activation_memory.activation_bytes` estimates what training keeps for the
backward pass; the RoPE functions and `activation_bytes` are importable from
here too (`generate` from `decoding`, which builds on this module).

Example:
  >>> from flax import nnx
  >>> model = Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 16), jnp.int32)).shape
  (2, 16, 259)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ai_stack import kernels
from jax_ai_stack.recipes.models import eager_sharding_scope
# Re-exported: the memory estimate and RoPE were defined here before they had modules.
from jax_ai_stack.recipes.models.activation_memory import (  # noqa: F401
    MATERIALIZING_ATTENTION, activation_bytes)
# The config lives in `configs` (no jax), for recipe configs to load cheaply; re-exported.
from jax_ai_stack.recipes.models.configs import (  # noqa: F401
    DType, DecoderConfig, RematPolicy, RopeScaling)
from jax_ai_stack.recipes.models.head import LOGPS_CHUNK_TOKENS, target_logps
from jax_ai_stack.recipes.models.moe import ACTIVATIONS, MoE, MoeStats
from jax_ai_stack.recipes.models.rope import (  # noqa: F401
    RopeTables, apply_rope, rope_inv_freq, rope_tables, rotate)

if TYPE_CHECKING:
  from jax_ai_stack.recipes.sharding import Layout

LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm", "layers")
_STACKED = {nnx.PARTITION_NAME: "layers"}
"""Transform metadata of `nnx.vmap`/`nnx.scan` over the blocks: the stacked
axis is named "layers" in each parameter's logical names."""
HIDDEN_AXES = ("batch", "length", None)
"""Logical names of the hidden states [B, T, D]. D stays whole: the parameters'
"embed" is split over fsdp, which the batch already uses."""

# What `jax.checkpoint` may keep from the forward pass, per `DecoderConfig.remat`.
# "full" keeps nothing (recompute the whole block); "save_dots" keeps the
# outputs of matmuls against weights (the FLOP-heavy part) and recomputes the
# attention scores and elementwise ops, whose memory grows with sequence length.
_REMAT_POLICIES = {
    "full": None,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}



class KVCache(NamedTuple):
  """Keys and values of every layer; the first `length` positions are filled.

  keys[i] and values[i] are [B, S, num_kv_heads, head_dim] for layer i: a tuple
  of arrays, or one stacked array [num_layers, B, S, ...] with `scan_layers`.
  """

  keys: tuple[jax.Array, ...] | jax.Array
  values: tuple[jax.Array, ...] | jax.Array
  length: jax.Array
  """int32: a scalar (every row holds as many tokens), or [B], one per row (the generation
  engine's slots, each at its own position; decoding one token at a time only)."""


def _fan_in_init(in_axis, out_axis):
  """Lecun-normal for kernels whose fan-in spans several (or leading) axes."""
  return nnx.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
  )


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE; k/v have `num_kv_heads` heads.

  The config's switches: biases on q/k/v (`qkv_bias`), an RMSNorm over each head
  of q and k before RoPE (`qk_norm`), the logits' scale and soft cap, and
  `layer`'s sliding window; the kernels get all three through their request.
  """

  def __init__(self, config: DecoderConfig, attention: kernels.AttentionPlan, *, rngs: nnx.Rngs,
               sharding: kernels.AttentionSharding | None = None, layer: int = 0):
    d, n, k, h = (
        config.d_model, config.num_heads, config.num_kv_heads, config.resolved_head_dim
    )
    dtypes = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
    in_init = _fan_in_init(in_axis=0, out_axis=(1, 2))

    def projection(heads: int, axis: str) -> nnx.Einsum:
      bias = dict(bias_shape=(heads, h), bias_init=nnx.with_partitioning(
          nnx.initializers.zeros, (axis, "head_dim"))) if config.qkv_bias else {}
      return nnx.Einsum(
          "btd,dnh->btnh", (d, heads, h), rngs=rngs, **dtypes, **bias,
          kernel_init=nnx.with_partitioning(in_init, ("embed", axis, "head_dim")),
      )

    self.q_proj = projection(n, "heads")
    self.k_proj = projection(k, "kv_heads")
    self.v_proj = projection(k, "kv_heads")
    self.o_proj = nnx.Einsum(
        "btnh,nhd->btd", (n, h, d), rngs=rngs, **dtypes,
        kernel_init=nnx.with_partitioning(
            _fan_in_init(in_axis=(0, 1), out_axis=2), ("heads", "head_dim", "embed")
        ),
    )
    if config.qk_norm:
      self.q_norm = rms_norm(config, rngs, h)
      self.k_norm = rms_norm(config, rngs, h)
    else:
      self.q_norm = self.k_norm = None
    self.attention_plan = attention
    self.attention_sharding = sharding
    self.local_window = config.local_window(layer)
    self.logits_soft_cap = config.attn_logit_softcap
    self.scale = config.attention_scale

  def _attend(self, q, k, v, *, causal, segment_ids=None, kv_seq_lengths=None,
              local_window=None):
    return kernels.attention(
        q, k, v, causal=causal, segment_ids=segment_ids, kv_seq_lengths=kv_seq_lengths,
        local_window=local_window, scale=self.scale, logits_soft_cap=self.logits_soft_cap,
        plan=self.attention_plan, sharding=self.attention_sharding,
    )

  def __call__(
      self,
      x: jax.Array,
      rope: RopeTables,
      segment_ids: jax.Array | None = None,
      cache: tuple[jax.Array, jax.Array, jax.Array] | None = None,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """x [B, T, D] -> ([B, T, D], updated (keys, values) or None).

    `rope`: the tables of the tokens' positions (`rope_tables`).

    With `cache` = (keys, values, length): the new keys/values are written at
    `length`. T > 1 is a prefill and must start an empty cache (length 0); T == 1
    decodes one token that attends to the first length + 1 cached positions
    (with a sliding window, to the last `window + 1` of them, read as one slice).
    """
    q, k = self.q_proj(x), self.k_proj(x)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = rotate(q, rope), rotate(k, rope)
    v = self.v_proj(x)
    window = self.local_window
    if cache is None:
      out = self._attend(q, k, v, causal=True, segment_ids=segment_ids, local_window=window)
      return self.o_proj(out), None
    keys, values, length = cache
    if jnp.ndim(length) == 1:  # One position per row (the engine's slots).
      return self._decode_rows(q, k, v, keys, values, length)
    keys = jax.lax.dynamic_update_slice_in_dim(keys, k.astype(keys.dtype), length, axis=1)
    values = jax.lax.dynamic_update_slice_in_dim(
        values, v.astype(values.dtype), length, axis=1
    )
    if x.shape[1] > 1:  # Prefill: nothing precedes the prompt, so its own keys suffice.
      out = self._attend(q, k, v, causal=True, local_window=window)
    elif window is not None and keys.shape[1] > window + 1:
      start = jnp.maximum(length - window, 0)  # The window's keys: one fixed-size slice.
      seen = jnp.full((x.shape[0],), length - start + 1, dtype=jnp.int32)
      recent = (jax.lax.dynamic_slice_in_dim(c, start, window + 1, axis=1) for c in (keys, values))
      out = self._attend(q, *recent, causal=False, kv_seq_lengths=seen)
    else:
      seen = jnp.full((x.shape[0],), length + 1, dtype=jnp.int32)
      out = self._attend(q, keys, values, causal=False, kv_seq_lengths=seen)
    return self.o_proj(out), (keys, values)

  def _decode_rows(self, q, k, v, keys, values, length):
    """One token per row, row i's written at `length[i]` and attending to its first
    length[i] + 1 cached positions (with a sliding window, the last window + 1 of them)."""
    rows = jnp.arange(q.shape[0])
    keys = keys.at[rows, length].set(k[:, 0].astype(keys.dtype))
    values = values.at[rows, length].set(v[:, 0].astype(values.dtype))
    window = self.local_window
    if window is not None and keys.shape[1] > window + 1:
      start = jnp.maximum(length - window, 0)
      index = (start[:, None] + jnp.arange(window + 1))[:, :, None, None]
      recent = (jnp.take_along_axis(c, index, axis=1) for c in (keys, values))
      out = self._attend(q, *recent, causal=False, kv_seq_lengths=length - start + 1)
    else:
      out = self._attend(q, keys, values, causal=False, kv_seq_lengths=length + 1)
    return self.o_proj(out), (keys, values)


def on_tokens(layer: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
  """`layer(x)` applied to x [..., D] as one [tokens, D] matrix, reshaped back.

  The same forward values, but a dense layer's weight gradient becomes one
  plain matmul: on a 3-D input XLA:CPU contracts the batch and sequence axes with
  layout copies around the dot (the tiny Llama's MLP forward+backward took 17 ms
  3-D, 10 ms flattened; the whole step 15-20% less; the gradients sum in another
  order, so their last bits differ). A reshape of the leading axes costs nothing,
  on a mesh too (the batch axis stays the sharded one).
  """
  y = layer(x.reshape(-1, x.shape[-1]))
  return y.reshape(*x.shape[:-1], y.shape[-1])


class MLP(nnx.Module):
  """A gated MLP: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with gelu_tanh."""

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    d, f = config.d_model, config.mlp_dim
    dtypes = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
    init = nnx.initializers.lecun_normal()
    self.gate_proj = nnx.Linear(
        d, f, use_bias=False, rngs=rngs, **dtypes,
        kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
    )
    self.up_proj = nnx.Linear(
        d, f, use_bias=False, rngs=rngs, **dtypes,
        kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
    )
    self.down_proj = nnx.Linear(
        f, d, use_bias=False, rngs=rngs, **dtypes,
        kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
    )
    self.activation = config.mlp_activation

  def __call__(self, x: jax.Array) -> jax.Array:
    act = ACTIVATIONS[self.activation]
    return on_tokens(lambda x: self.down_proj(act(self.gate_proj(x)) * self.up_proj(x)), x)


class OffsetRMSNorm(nnx.RMSNorm):
  """RMSNorm scaled by (offset + weight), in float32: Gemma's `x * (1 + w)` with offset 1.

  The weight starts at 1 - offset, so a new norm is the identity as Llama's is.
  """

  def __init__(self, num_features: int, *, offset: float, **kwargs):
    super().__init__(num_features, **kwargs)
    self.offset = offset

  def __call__(self, x, mask=None):
    del mask
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
    y = y * (self.offset + self.scale[...].astype(jnp.float32))
    return y.astype(self.dtype or x.dtype)


def rms_norm(config: DecoderConfig, rngs: nnx.Rngs, features: int | None = None) -> nnx.RMSNorm:
  """An RMSNorm over `features` (default d_model) with the config's eps and `norm_offset`."""
  kwargs = dict(epsilon=config.norm_eps, rngs=rngs, dtype=jnp.dtype(config.dtype),
                param_dtype=jnp.dtype(config.param_dtype))
  features = config.d_model if features is None else features
  if not config.norm_offset:
    return nnx.RMSNorm(features, **kwargs, scale_init=nnx.with_partitioning(
        nnx.initializers.ones, ("norm",)))
  start = nnx.initializers.constant(1.0 - config.norm_offset)
  return OffsetRMSNorm(features, offset=config.norm_offset, **kwargs,
                       scale_init=nnx.with_partitioning(start, ("norm",)))


class Block(nnx.Module):
  """One pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x)).

  With `post_norms` (Gemma 2/3) each branch's output is normed before its add.
  The MLP is a mixture of experts (`moe.MoE`) in the layers `config.moe_layers`
  names; the block then also returns the layer's `moe.MoeStats` (else None).
  """

  def __init__(self, config: DecoderConfig, attention: kernels.AttentionPlan, *, rngs: nnx.Rngs,
               layout: Layout | None = None, layer: int = 0):
    self.attention_norm = rms_norm(config, rngs)
    self.attention = Attention(config, attention, rngs=rngs, layer=layer,
                               sharding=layout.attention() if layout else None)
    self.mlp_norm = rms_norm(config, rngs)
    self.mlp = (MoE(config, rngs=rngs, layout=layout) if config.moe_layers[layer]
                else MLP(config, rngs=rngs))
    if config.post_norms:
      self.post_attention_norm = rms_norm(config, rngs)
      self.post_mlp_norm = rms_norm(config, rngs)
    else:
      self.post_attention_norm = self.post_mlp_norm = None
    self.layout = layout

  def __call__(self, x, rope: RopeTables, segment_ids=None, cache=None):
    h, new_cache = self.attention(self.attention_norm(x), rope, segment_ids, cache)
    if self.post_attention_norm is not None:
      h = self.post_attention_norm(h)
    x = x + _constrain(self.layout, h)
    if isinstance(self.mlp, MoE):
      h, stats = self.mlp(self.mlp_norm(x), segment_ids)
    else:
      h, stats = self.mlp(self.mlp_norm(x)), None
    if self.post_mlp_norm is not None:
      h = self.post_mlp_norm(h)
    return x + _constrain(self.layout, h), new_cache, stats


def _constrain(layout: Layout | None, x: jax.Array) -> jax.Array:
  """Hidden states [B, T, D] pinned where `layout` says; as they are without one."""
  return x if layout is None else layout.constrain(x, HIDDEN_AXES)


def _block_output(block: Block, x, rope, segment_ids):
  """A block's output and MoE stats without the cache, in a form `nnx.remat` can wrap."""
  x, _, stats = block(x, rope, segment_ids)
  return x, stats


def _stacked_blocks(config: DecoderConfig, attention, rngs: nnx.Rngs, layout) -> Block:
  """One Block whose parameters are stacked [num_layers, ...], each layer its own init."""

  @nnx.split_rngs(splits=config.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=_STACKED)
  def make(rngs):
    return Block(config, attention, rngs=rngs, layout=layout)

  return make(rngs)


def _scan_blocks(run_block, blocks: Block, x, rope, segment_ids):
  """x through every layer of the stacked `blocks`, one traced block for all."""

  @nnx.scan(in_axes=(nnx.Carry, 0, None, None), out_axes=(nnx.Carry, 0),
            transform_metadata=_STACKED)
  def body(x, block, rope, segment_ids):
    return run_block(block, x, rope, segment_ids)

  x, stats = body(x, blocks, rope, segment_ids)
  return x, [] if stats is None else [jax.tree.map(lambda s: s.mean(axis=0), stats)]


def _scan_decode(blocks: Block, x, rope, cache: KVCache):
  """`_scan_blocks` with each layer's slice of the stacked cache; its new keys/values."""
  keys, values = cache.keys, cache.values
  if isinstance(keys, (tuple, list)):  # A per-layer cache: stack it.
    keys, values = jnp.stack(keys), jnp.stack(values)

  @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0, None, None), out_axes=(nnx.Carry, 0, 0),
            transform_metadata=_STACKED)
  def body(x, block, k, v, rope, length):
    x, (k, v), _ = block(x, rope, cache=(k, v, length))
    return x, k, v

  return body(x, blocks, keys, values, rope, cache.length)


class Decoder(nnx.Module):
  """A Llama-style decoder: int32 tokens [B, T] -> float32 logits [B, T, vocab_size].

  The embedding and head have `config.padded_vocab_size` rows; the padded
  rows' logits are dropped, so they never win a softmax, a sample or a loss.

  `attention`: the kernels it may run (hashable, so it is part of the model's
  static structure); default `config.attention_impl` on this backend.
  `layout`: the mesh and logical rules of its activations (hashable too), from
  `sharding.Placement.layout()`; None (one device): no constraints.
  """

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs,
               attention: kernels.AttentionPlan | None = None, layout: Layout | None = None):
    self.config = config
    self.layout = layout
    attention = attention or kernels.resolve_plan(  # The config alone: no environment.
        config.attention_impl, origin="model.attention_impl", environ={})
    with eager_sharding_scope():
      self.embed = nnx.Embed(
          config.padded_vocab_size, config.d_model, rngs=rngs,
          dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype),
          embedding_init=nnx.with_partitioning(
              _zero_padding(nnx.initializers.normal(stddev=0.02), 0, config.vocab_size),
              ("vocab", "embed")),
      )
      if config.scan_layers:
        self.layers = _stacked_blocks(config, attention, rngs, layout)
      else:
        self.layers = nnx.List(
            [Block(config, attention, rngs=rngs, layout=layout, layer=i)
             for i in range(config.num_layers)])
      self.final_norm = rms_norm(config, rngs)
      if config.tie_embeddings:
        self.lm_head = None
      else:
        self.lm_head = nnx.Linear(
            config.d_model, config.padded_vocab_size, use_bias=False, rngs=rngs,
            dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype),
            kernel_init=nnx.with_partitioning(
                _zero_padding(nnx.initializers.lecun_normal(), 1, config.vocab_size),
                ("embed", "vocab")),
        )

  def __call__(
      self,
      tokens: jax.Array,
      *,
      segment_ids: jax.Array | None = None,
      positions: jax.Array | None = None,
      with_moe_losses: bool = False,
      targets: jax.Array | None = None,
      chunk_tokens: int = LOGPS_CHUNK_TOKENS,
  ) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
    """Logits [B, T, vocab] (float32) for int tokens [B, T]; with `targets`, the
    log-probability of each target instead, [B, T] (float32), computed over the sequence
    in chunks of `chunk_tokens` so that no [B, T, vocab] array exists (`target_logps`).

    Args:
      tokens: int token ids [B, T].
      segment_ids: [B, T] ints, 1, 2, ... per packed document (0: padding);
        tokens attend only within their own segment. None: one document.
      positions: [B, T] position of each token within its document (restarting
        at 0 in each one); drives RoPE. None: arange(T) in every row.
      with_moe_losses: also return the MoE layers' losses and metrics (`moe_losses`;
        {} for a dense model), as (logits, losses).
      targets: int token ids [B, T] whose log-probabilities to return (the next tokens).
      chunk_tokens: positions of the sequence per chunk of the head (`targets` only).

    The objectives ask for `targets`: Qwix intercepts one method of a model (its LoRA
    adapters and fake quantization live in `__call__`), so the head runs here too.
    """
    _check_tokens(tokens, segment_ids=segment_ids, positions=positions)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    ropes = self._ropes(positions)
    x = self._embed(tokens)
    if self.config.remat == "none":
      run_block = _block_output
    else:
      run_block = nnx.remat(_block_output, policy=_REMAT_POLICIES[self.config.remat])
    if self.config.scan_layers:  # Identical blocks (the config checks): layer 0's RoPE.
      x, stats = _scan_blocks(run_block, self.layers, x, ropes[0], segment_ids)
    else:
      stats = []
      for block, rope in zip(self.layers, ropes):
        x, layer_stats = run_block(block, x, rope, segment_ids)
        stats += [layer_stats] if layer_stats is not None else []
    if targets is None:
      out = self._logits(x)
    else:
      out = target_logps(self._logits, x, targets, chunk_tokens)
    return (out, moe_losses(self.config, stats)) if with_moe_losses else out

  def init_cache(self, batch_size: int, max_length: int) -> KVCache:
    """An empty KV cache for `batch_size` rows of up to `max_length` tokens."""
    c = self.config
    shape = (batch_size, max_length, c.num_kv_heads, c.resolved_head_dim)
    if c.scan_layers:
      zeros = jnp.zeros((c.num_layers, *shape), jnp.dtype(c.dtype))
    else:
      zeros = tuple(jnp.zeros(shape, jnp.dtype(c.dtype)) for _ in range(c.num_layers))
    return KVCache(keys=zeros, values=zeros, length=jnp.zeros((), jnp.int32))

  def decode(self, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Logits of `tokens` [B, T] that follow the `cache.length` cached ones.

    T > 1 is a prefill of an empty cache (the prompt); T == 1 is one decoding
    step (with `cache.length` [B], row i's token at its own position length[i]).
    Returns float32 logits [B, T, vocab] and the cache with T more tokens.
    """
    _check_tokens(tokens)
    t = tokens.shape[1]
    if jnp.ndim(cache.length) == 1 and t != 1:
      raise ValueError(f"a cache with one length per row decodes one token at a time; got {t}")
    positions = jnp.reshape(cache.length, (-1, 1)) + jnp.arange(t)
    ropes = self._ropes(jnp.broadcast_to(positions, tokens.shape))
    x = self._embed(tokens)
    if self.config.scan_layers:
      x, keys, values = _scan_decode(self.layers, x, ropes[0], cache)
      return self._logits(x), KVCache(keys, values, cache.length + t)
    keys, values = [], []
    for i, (block, rope) in enumerate(zip(self.layers, ropes)):
      x, (k, v), _ = block(x, rope, cache=(cache.keys[i], cache.values[i], cache.length))
      keys.append(k)
      values.append(v)
    return self._logits(x), KVCache(tuple(keys), tuple(values), cache.length + t)

  def _ropes(self, positions: jax.Array) -> list[RopeTables]:
    """Each layer's RoPE tables, computed once per distinct (theta, scaling)."""
    config, tables = self.config, {}
    out = []
    for layer in range(config.num_layers):
      key = config.rope(layer)
      if key not in tables:
        tables[key] = rope_tables(positions, config.resolved_head_dim, *key)
      out.append(tables[key])
    return out

  def _embed(self, tokens: jax.Array) -> jax.Array:
    if self.layout is None:
      x = self.embed(tokens)
    else:  # `nnx.Embed`'s lookup from the table made whole first (XLA gathers it anyway),
      # so that the rows come out split like the tokens: looked up in the split table,
      # they came out split along d_model, and XLA replicated them to split them again.
      (table,) = self.embed.promote_dtype((self.embed.embedding[...],), dtype=self.embed.dtype,
                                          inexact=False)
      x = jnp.take(self.layout.constrain(table, (None, None)), tokens, axis=0)
    if self.config.embed_scale:  # Gemma's sqrt(d_model), rounded to the compute dtype.
      x = x * jnp.asarray(self.config.d_model ** 0.5, x.dtype)
    return _constrain(self.layout, x)

  def _logits(self, x: jax.Array) -> jax.Array:
    x = self.final_norm(x)
    logits = on_tokens(self.embed.attend if self.lm_head is None else self.lm_head, x)
    if self.config.padded_vocab_size != self.config.vocab_size:
      logits = logits[..., :self.config.vocab_size]  # Padded rows: no token, no logit.
    logits = logits.astype(jnp.float32)
    if (cap := self.config.final_logit_softcap) is not None:
      logits = cap * jnp.tanh(logits / cap)
    return logits


def moe_losses(config: DecoderConfig, stats: list[MoeStats]) -> dict[str, jax.Array]:
  """The MoE layers' stats as a loss and metrics: `moe_loss` (what training adds:
  router_aux_loss_coef * balance + router_z_loss_coef * z), the balance and z losses
  (mean over the MoE layers) and each expert's mean token share, `expert_share_<e>`."""
  if not stats:
    return {}
  mean = jax.tree.map(lambda *s: sum(s) / len(s), *stats)
  moe = config.moe
  out = {"moe_loss": moe.router_aux_loss_coef * mean.balance_loss
                     + moe.router_z_loss_coef * mean.z_loss,
         "router_aux_loss": mean.balance_loss, "router_z_loss": mean.z_loss}
  return {**out, **{f"expert_share_{e}": mean.share[e] for e in range(moe.num_experts)}}


def _zero_padding(init, axis: int, vocab_size: int):
  """`init` drawn for vocab_size entries along `axis`, then zeros up to the padded shape.

  The real rows get the values an unpadded model gets from the same key. The
  padded ones stay zero: no token reads a padded embedding row and no loss sees a
  padded logit, so their gradients, Adam updates and weight decay are zero, and
  an export (which drops them) and import (which pads zeros) round-trip bitwise.
  """

  def initializer(key, shape, dtype=jnp.float32):
    real = (*shape[:axis], vocab_size, *shape[axis + 1:])
    values = init(key, real, dtype)
    pad = [(0, size - kept) for size, kept in zip(shape, real)]
    return jnp.pad(values, pad) if shape[axis] != vocab_size else values

  return initializer


def _check_tokens(tokens, **same_shape) -> None:
  """Raises ValueError naming the argument whose shape or dtype is wrong."""
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(
        f"tokens must be an int array [batch, seq]; got {tokens.dtype}{list(tokens.shape)}"
    )
  for name, value in same_shape.items():
    if value is not None and value.shape != tokens.shape:
      raise ValueError(
          f"{name} must have the shape of tokens {tuple(tokens.shape)}; "
          f"got {tuple(value.shape)}"
      )
