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
The cache is then stacked too (keys [num_layers, B, S, K, H]).
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

The layers (attention and its KV cache, MLP, norms, `Block`) are in `layers`. What a
layer caches is its attention's to say (`cache_spec`, `models.cache`): `init_pages` and
`init_cache` lay every layer's out, and `decode` hands each layer its own.
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

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ai_stack import kernels
from jax_ai_stack.recipes.models import cache as cache_lib
from jax_ai_stack.recipes.models import eager_sharding_scope
# Re-exported: the memory estimate and RoPE were defined here before they had modules.
from jax_ai_stack.recipes.models.activation_memory import (  # noqa: F401
    MATERIALIZING_ATTENTION, activation_bytes)
# The config lives in `configs` (no jax), for recipe configs to load cheaply; re-exported.
from jax_ai_stack.recipes.models.configs import (  # noqa: F401
    DType, DecoderConfig, RematPolicy, RopeScaling)
from jax_ai_stack.recipes.models.head import (LOGPS_CHUNK_TOKENS, LinearHead,
                                               linear_target_logps, target_logps)
# The layers live in `layers`; re-exported, since they were defined here first.
from jax_ai_stack.recipes.models.block import Block
from jax_ai_stack.recipes.models.layers import (  # noqa: F401
    HIDDEN_AXES, MLP, Attention, KVCache, OffsetRMSNorm, constrain, on_tokens, rms_norm)
from jax_ai_stack.recipes.models.moe import MoeStats
from jax_ai_stack.recipes.models.rope import (  # noqa: F401
    RopeTables, apply_rope, rope_inv_freq, rope_tables, rotate)

if TYPE_CHECKING:
  from jax_ai_stack.recipes.sharding import Layout

LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm", "layers")
_STACKED = {nnx.PARTITION_NAME: "layers"}
"""Transform metadata of `nnx.vmap`/`nnx.scan` over the blocks: the stacked
axis is named "layers" in each parameter's logical names."""

# What `jax.checkpoint` may keep from the forward pass, per `DecoderConfig.remat`.
# "full" keeps nothing (recompute the whole block); "save_dots" keeps the
# outputs of matmuls against weights (the FLOP-heavy part) and recomputes the
# attention scores and elementwise ops, whose memory grows with sequence length.
_REMAT_POLICIES = {
    "full": None,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}





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
  """`_scan_blocks` with each layer's slice of the stacked cache state; the new state."""
  state = cache.state
  if isinstance(state, (tuple, list)):  # A per-layer cache: stack it.
    state = jax.tree.map(lambda *layers: jnp.stack(layers), *state)

  @nnx.scan(in_axes=(nnx.Carry, 0, 0, None, None), out_axes=(nnx.Carry, 0),
            transform_metadata=_STACKED)
  def body(x, block, state, rope, cache):
    x, state, _ = block(x, rope, cache=cache._replace(state=state))
    return x, state

  return body(x, blocks, state, rope, cache._replace(state=None))


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
      hidden: bool = False,
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
      hidden: return the last layer's hidden states [B, T, D] instead, before the final
        norm and the head (`head_logits` makes logits of them, a chunk at a time).

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
    if hidden:
      out = x
    else:
      out = self._logits(x) if targets is None else self._target_logps(x, targets, chunk_tokens)
    return (out, moe_losses(self.config, stats)) if with_moe_losses else out

  def head_logits(self, x: jax.Array) -> jax.Array:
    """Float32 logits [..., vocab] of hidden states as `__call__(hidden=True)` returns them:
    the final norm, the head (vocabulary padding dropped) and its soft cap. A distillation
    loss makes them for a chunk of positions at a time, the student's and the teacher's."""
    return self._logits(x)

  def cache_specs(self, paged: bool = True) -> list[cache_lib.Spec]:
    """Each layer's cache spec (its attention's `cache_spec`): what `init_pages` (paged) and
    `init_cache` (not) lay out. A stacked model's layers share one."""
    if self.config.scan_layers:
      return [self.layers.attention.cache_spec(paged)] * self.config.num_layers
    return [block.attention.cache_spec(paged) for block in self.layers]

  def init_cache(self, batch_size: int, max_length: int) -> KVCache:
    """An empty cache for `batch_size` rows of up to `max_length` tokens, each layer's
    contiguous (`cache_specs(paged=False)`), for `decode` without a block table."""
    state = cache_lib.lay_out(self.cache_specs(paged=False),
                              {cache_lib.SLOTS: batch_size, cache_lib.LENGTH: max_length},
                              stacked=self.config.scan_layers)
    return KVCache(state, length=jnp.zeros((), jnp.int32))

  def page_replicas(self, rows: int) -> int:
    """Into how many groups this model's mesh splits `rows` decoding rows (its batch axes,
    where they divide the rows; 1 on one device): the pools of pages a paged cache
    should hold, one per group (`init_pages`), so that each replica reads its own."""
    if self.layout is None:
      return 1
    sharding = self.layout.attention()
    replicas = sharding.size(sharding.batch)
    return replicas if rows % replicas == 0 else 1

  def init_pages(self, pages: int, page_size: int, replicas: int = 1, *, slots: int = 1):
    """The engine's empty cache state (`KVCache.state`): every layer's spec laid out with
    `pages` pages of `page_size` positions and `slots` slots of per-slot state, per replica
    (more than one: a replica axis, `cache.lay_out`, placed on the mesh by
    `page_sharding`). The plain decoder's: keys and values [K, pages, page_size, H] per
    layer ([K, replicas, pages, ...] with replicas; stacked: [num_layers, ...]), or for the
    TPU's kernel one pool in its layout, [pages, page_size, 2K, H] (`Attention.cache_spec`)."""
    sizes = {cache_lib.PAGES: pages, cache_lib.PAGE_SIZE: page_size, cache_lib.SLOTS: slots}
    specs, stacked = self.cache_specs(), self.config.scan_layers
    placed = self.page_sharding(replicas)
    state = lambda: cache_lib.lay_out(specs, sizes, replicas, stacked=stacked)
    if placed is None:
      return state()
    return jax.jit(state, out_shardings=placed)()  # Each device makes its part.

  def page_sharding(self, replicas: int):
    """Where `init_pages`' state of `replicas` replicas lives (a pytree like it): replica
    r's pools and slots where `page_replicas`' group r of rows lives, the heads split as the
    attention's; None for one replica (the default placement)."""
    if replicas == 1 or self.layout is None:
      return None
    sharding = self.layout.attention()
    return cache_lib.shardings(self.cache_specs(), sharding.mesh, sharding.batch,
                               sharding.heads, sharding.size(sharding.heads),
                               stacked=self.config.scan_layers)

  def reset_slot(self, state, replica, slot):
    """`init_pages`' `state` with slot `slot` of replica `replica` emptied: what the engine
    does when it admits a request there (a no-op for paged arrays: the block table says
    which pages a slot reads)."""
    return cache_lib.reset_slot(self.cache_specs(), state, replica, slot,
                                stacked=self.config.scan_layers)

  def page_bytes(self, page_size: int) -> tuple[int, int]:
    """(bytes of one page of `page_size` positions, bytes of one slot's per-slot state) over
    every layer: what an engine's cache costs."""
    sizes = {cache_lib.PAGES: 1, cache_lib.PAGE_SIZE: page_size, cache_lib.SLOTS: 1}
    arrays = [a for spec in self.cache_specs() for a in spec.values()]
    return (sum(a.bytes(sizes) for a in arrays if not a.per_slot),
            sum(a.bytes(sizes) for a in arrays if a.per_slot))

  def decode(self, tokens: jax.Array, cache: KVCache,
             logits_at: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Logits of `tokens` [B, T] that follow the `cache.length` cached ones.

    T > 1 is a prefill of an empty cache (the prompt); T == 1 is one decoding
    step. A paged cache (`cache.block_table`, the engine's, with `cache.length` [B]) takes
    T tokens per row at positions length[i] ...: a prompt chunk by chunk, or one step.
    Returns float32 logits [B, T, vocab] and the cache with T more tokens; with `logits_at`
    (int32 [B]) the logits of row b's token logits_at[b] alone, [B, 1, vocab]: what a
    prefill samples from, without the head's work and memory for every token of the
    prompt (T x vocab logits a row: a 256-token chunk of a 150k vocabulary is 150 MB).
    """
    _check_tokens(tokens)
    t = tokens.shape[1]
    if jnp.ndim(cache.length) == 1 and cache.block_table is None:
      raise ValueError("a cache with one length per row is a paged one: give its block_table")
    positions = jnp.broadcast_to(jnp.reshape(cache.length, (-1, 1)) + jnp.arange(t), tokens.shape)
    longest = None if logits_at is None else jnp.take_along_axis(  # A padded chunk's last token.
        positions, jnp.reshape(logits_at, (-1, 1)), axis=1)[:, 0]
    ropes = self._ropes(positions, longest)
    x = self._embed(tokens)
    if self.config.scan_layers:
      x, state = _scan_decode(self.layers, x, ropes[0], cache)
    else:
      state = []
      for layer, block, rope in zip(cache.state, self.layers, ropes):
        x, layer, _ = block(x, rope, cache=cache._replace(state=layer))
        state.append(layer)
      state = tuple(state)
    if logits_at is not None:
      x = jnp.take_along_axis(x, jnp.reshape(logits_at, (-1, 1, 1)), axis=1)
    return self._logits(x), cache._replace(state=state, length=cache.length + t)

  def _ropes(self, positions: jax.Array, longest: jax.Array | None = None) -> list[RopeTables]:
    """Each layer's RoPE tables, computed once per distinct (theta, scaling); `longest`: each
    row's last position that holds a token, where it is not the last of `positions`
    (LongRoPE's choice of factors follows it: `rope_tables`)."""
    config, tables = self.config, {}
    out = []
    for layer in range(config.num_layers):
      key = config.rope(layer)
      if key not in tables:
        rotary = config.rotary_features
        tables[key] = rope_tables(positions, rotary, *key, longest=longest)
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
    return constrain(self.layout, x)

  def _target_logps(self, x: jax.Array, targets: jax.Array, chunk_tokens: int) -> jax.Array:
    """log softmax(logits)[targets] in chunks. On one device with a plain head, through
    `head.linear_target_logps`, whose backward pass tiles the vocabulary too; with LoRA
    adapters on the head (Qwix adds them inside the head's call) or on a mesh (the tiles
    would cut across a vocabulary split over devices), through `head.target_logps`."""
    head = self.embed if self.lm_head is None else self.lm_head
    if self.layout is not None or jax.tree.leaves(nnx.state(head, nnx.LoRAParam)):
      return target_logps(self._logits, x, targets, chunk_tokens)
    linear = LinearHead(self.config.vocab_size, jnp.dtype(self.config.dtype),
                        self.config.final_logit_softcap, vocab_major=self.lm_head is None)
    weight = head.embedding[...] if self.lm_head is None else head.kernel[...]
    return linear_target_logps(linear, self.final_norm(x), weight, targets, chunk_tokens)

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
  """The MoE layers' stats as a loss and metrics: `moe_loss` (what training adds: aux coef
  * balance + z coef * z + `MoeStats.balancing`, zero), the balance and z losses
  (mean over the MoE layers) and each expert's mean token share, `expert_share_<e>`."""
  if not stats:
    return {}
  mean = jax.tree.map(lambda *s: sum(s) / len(s), *stats)
  moe = config.moe
  out = {"moe_loss": moe.router_aux_loss_coef * mean.balance_loss
                     + moe.router_z_loss_coef * mean.z_loss + mean.balancing,
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
