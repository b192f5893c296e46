"""Paged attention: equal to a dense causal softmax over each row's positions (decoding
and chunks of queries, grouped queries, a soft cap, a sliding window), bitwise the same
however wide the table; JAX's Pallas GPU kernel (interpret mode here) equal to the XLA
loop, which takes the calls the kernel cannot; the adapter of JAX's TPU kernel (with the
kernel's own reference in its place: TPU interpret mode cannot run it) equal to it too;
the choice per backend."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from flax import nnx
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as ragged
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

from jax_ai_stack import kernels
from jax_ai_stack.kernels import paged
from jax_ai_stack.recipes.models import layers
from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.decoder import Decoder
from jax_ai_stack.kernels import paged_tpu
from jax_ai_stack.kernels.paged import choose_paged_attention, paged_attention
from jax_ai_stack.kernels.paged_tpu import fuse_pages, pallas_tpu, tpu_kernel_fits

RNG = np.random.default_rng(0)
PAGE, HEADS, KV_HEADS, DIM = 4, 4, 2, 8


def _pool_and_tables(rows, width):
  """Random pools (keys, values) [K, pages, PAGE, H], each row's positions on pages drawn
  at random (page 0 unused), and the same keys laid out densely [B, width * PAGE, K, H]."""
  pages = 1 + RNG.permutation(len(rows) * width)
  tables = pages.reshape(len(rows), width).astype(np.int32)
  pool = RNG.normal(size=(2, KV_HEADS, 1 + pages.size, PAGE, DIM)).astype(np.float32)
  dense = np.moveaxis(pool[:, :, tables], 1, -2)  # [2, B, width, PAGE, K, H]
  return pool, tables, dense.reshape(2, len(rows), width * PAGE, KV_HEADS, DIM)


def _dense(q, keys, values, positions, scale, cap=None, window=None):
  """softmax over each query's positions [first, position], in float64."""
  group = HEADS // KV_HEADS
  out = np.zeros(q.shape)
  for (b, t), position in np.ndenumerate(positions):
    first = 0 if window is None else max(0, position - window)
    for n in range(HEADS):
      k = keys[b, first:position + 1, n // group]
      v = values[b, first:position + 1, n // group]
      logits = (k.astype(np.float64) @ q[b, t, n]) * scale
      if cap is not None:
        logits = np.tanh(logits / cap) * cap
      weights = np.exp(logits - logits.max())
      out[b, t, n] = weights @ v / weights.sum()
  return out


@pytest.mark.parametrize("cap, window", [(None, None), (5.0, None), (None, 5), (3.0, 2)])
@pytest.mark.parametrize("positions", [[[0], [6], [11], [15]],  # Decoding: a query a row.
                                       [[5, 6, 7], [0, 1, 2], [13, 14, 15], [8, 9, 10]]])
def test_equals_a_dense_causal_softmax_over_each_row_s_positions(cap, window, positions):
  positions = np.asarray(positions, np.int32)
  pool, tables, (keys, values) = _pool_and_tables(positions, width=4)
  q = RNG.normal(size=(*positions.shape, HEADS, DIM)).astype(np.float32)
  out = paged_attention(jnp.asarray(q), jnp.asarray(pool[0]), jnp.asarray(pool[1]),
                        jnp.asarray(tables), jnp.asarray(positions), scale=0.3,
                        logits_soft_cap=cap, local_window=window)
  np.testing.assert_allclose(np.asarray(out),
                             _dense(q, keys, values, positions, 0.3, cap, window),
                             rtol=1e-5, atol=1e-5)


def test_pages_past_a_row_s_length_change_no_bit_of_it():
  """The same rows with a table twice as wide, its extra pages full of large values: the
  engine reads as many pages as its longest row needs, so this is batch invariance."""
  positions = jnp.asarray([[1, 2], [6, 7]])
  pool, tables, _ = _pool_and_tables(positions, width=2)
  garbage = 100 * RNG.normal(size=(2, KV_HEADS, 4, *pool.shape[3:]))
  wide_pool = np.concatenate([pool, garbage], axis=2).astype(np.float32)
  extra = np.arange(pool.shape[2], pool.shape[2] + 4, dtype=np.int32).reshape(2, 2)
  q = jnp.asarray(RNG.normal(size=(2, 2, HEADS, DIM)).astype(np.float32))
  for window in (None, 3):
    narrow = paged_attention(q, jnp.asarray(pool[0]), jnp.asarray(pool[1]), jnp.asarray(tables),
                             positions, scale=0.3, local_window=window)
    wide = paged_attention(q, jnp.asarray(wide_pool[0]), jnp.asarray(wide_pool[1]),
                           jnp.asarray(np.concatenate([tables, extra], axis=1)),
                           positions, scale=0.3, local_window=window)
    assert np.array_equal(np.asarray(narrow), np.asarray(wide))


@pytest.mark.parametrize("group_floats", [128, 64], ids=["groups of 2 rows", "of 1"])
def test_rows_in_groups_equal_the_dense_softmax_and_keep_their_bits_whoever_is_beside(
    group_floats, monkeypatch):
  """Rows in groups (a small `GROUP_FLOATS` here: a row reads 64 floats of keys a page), the
  longest first, each group's loop as long as its longest row: the dense softmax still;
  and row 0 gives the same bits whatever its neighbours' lengths, which change its group
  and the loops' lengths."""
  monkeypatch.setattr(paged, "GROUP_FLOATS", group_floats)
  q = RNG.normal(size=(4, 1, HEADS, DIM)).astype(np.float32)
  pool, tables, (keys, values) = _pool_and_tables(range(4), width=4)
  row_0 = []
  for others in ([1, 13, 7], [15, 0, 2], [3, 3, 14]):
    positions = np.asarray([[9]] + [[p] for p in others], np.int32)
    out = paged_attention(jnp.asarray(q), jnp.asarray(pool[0]), jnp.asarray(pool[1]),
                          jnp.asarray(tables), jnp.asarray(positions), scale=0.3)
    np.testing.assert_allclose(np.asarray(out), _dense(q, keys, values, positions, 0.3),
                               rtol=1e-5, atol=1e-5)
    row_0.append(np.asarray(out[0]))
  assert all(np.array_equal(out, row_0[0]) for out in row_0)


def test_groups_halve_while_each_reads_enough_of_a_page():
  assert paged._group_rows(16, 2 * 64 * 16) == 16  # The tiny benchmark model's rows.
  assert paged._group_rows(16, 2 * 64 * 64) == 4  # The 25M one's.
  assert paged._group_rows(16, 8 * 64 * 128) == 1 and paged._group_rows(6, 8192) == 6


def test_the_xla_loop_runs_per_replica_inside_a_shard_map_over_data():
  """Each data-parallel replica can attend over a pool of its own (rows, pool and table
  split over `data`, page numbers local): the loop's state varies as its queries do, as
  shard_map's type check asks (one device here; the check is the same on many)."""
  positions = np.asarray([[5, 6], [9, 10]], np.int32)
  pool, tables, _ = _pool_and_tables(positions, width=4)
  args = (jnp.asarray(RNG.normal(size=(2, 2, HEADS, DIM)).astype(np.float32)),
          jnp.asarray(pool[0]), jnp.asarray(pool[1]), jnp.asarray(tables),
          jnp.asarray(positions))
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rows, pages = jax.P("data"), jax.P(None, "data")
  per_replica = jax.jit(jax.shard_map(
      functools.partial(paged_attention, scale=0.3, local_window=3, implementation="xla"),
      mesh=mesh, in_specs=(rows, pages, pages, rows, rows), out_specs=rows))
  whole = paged_attention(*args, scale=0.3, local_window=3, implementation="xla")
  assert np.array_equal(np.asarray(per_replica(*args)), np.asarray(whole))


@pytest.mark.parametrize("cap, width", [(None, 4), (5.0, 4), (None, 24)])
def test_the_pallas_gpu_kernel_equals_the_xla_loop_when_decoding(cap, width):
  """Interpret mode on this CPU: the kernel's own code, run by JAX's interpreter; a table
  width that is not a power of two too (the kernel splits it in whole blocks)."""
  positions = np.asarray([[0], [6], [11], [15]], np.int32)
  pool, tables, _ = _pool_and_tables(positions, width=width)
  args = (jnp.asarray(RNG.normal(size=(4, 1, HEADS, DIM)).astype(np.float32)),
          jnp.asarray(pool[0]), jnp.asarray(pool[1]), jnp.asarray(tables),
          jnp.asarray(positions))
  pallas, xla = (paged_attention(*args, scale=0.3, logits_soft_cap=cap, implementation=name)
                 for name in ("pallas_gpu", "xla"))
  np.testing.assert_allclose(np.asarray(pallas), np.asarray(xla), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("positions, window", [([[5, 6, 7]], None), ([[9]], 3)])
def test_what_the_pallas_kernel_cannot_take_runs_the_xla_loop(positions, window):
  """A prompt's chunk (several queries a row) or a sliding window: the same bits as xla."""
  positions = np.asarray(positions, np.int32)
  pool, tables, _ = _pool_and_tables(positions, width=4)
  args = (jnp.asarray(RNG.normal(size=(*positions.shape, HEADS, DIM)).astype(np.float32)),
          jnp.asarray(pool[0]), jnp.asarray(pool[1]), jnp.asarray(tables),
          jnp.asarray(positions))
  pallas, xla = (paged_attention(*args, scale=0.3, local_window=window, implementation=name)
                 for name in ("pallas_gpu", "xla"))
  assert np.array_equal(np.asarray(pallas), np.asarray(xla))


@pytest.mark.parametrize("cap, window", [(None, None), (5.0, None), (None, 5), (3.0, 2)])
@pytest.mark.parametrize("positions", [[[0], [6], [11], [15]],
                                       [[5, 6, 7], [0, 1, 2], [13, 14, 15], [8, 9, 10]]])
def test_the_pallas_tpu_adapter_equals_the_xla_loop_with_the_kernel_s_reference(
    cap, window, positions):
  """The pages gathered into the kernel's layout (keys and values of each head side by
  side), the table renumbered, a row's queries its last positions, the window counted as
  the kernel counts it (keys after position - window): JAX's reference of the kernel, run
  on what the adapter hands the kernel, gives the XLA loop's attention."""
  positions = np.asarray(positions, np.int32)
  pool, tables, _ = _pool_and_tables(positions, width=4)
  args = (jnp.asarray(RNG.normal(size=(*positions.shape, HEADS, DIM)).astype(np.float32)),
          jnp.asarray(pool[0]), jnp.asarray(pool[1]), jnp.asarray(tables),
          jnp.asarray(positions))
  q, k_pages, v_pages, table, at = args
  adapted = pallas_tpu(q, *fuse_pages(k_pages, v_pages, table), at, scale=0.3,
                       logits_soft_cap=cap, local_window=window,
                       kernel=ragged.ref_ragged_paged_attention)
  xla = paged_attention(*args, scale=0.3, logits_soft_cap=cap, local_window=window,
                        implementation="xla")
  np.testing.assert_allclose(np.asarray(adapted), np.asarray(xla), rtol=1e-5, atol=1e-5)


def test_the_tpu_kernel_takes_head_dims_of_128_and_heads_it_can_tile():
  q128 = jnp.zeros((1, 1, 4, 128))
  pool = lambda heads, dtype=jnp.float32: jnp.zeros((heads, 2, 16, 128), dtype)
  assert tpu_kernel_fits(q128, pool(2)) and tpu_kernel_fits(q128, pool(8))
  assert tpu_kernel_fits(q128, pool(1, jnp.bfloat16))  # Two bf16 heads in one 32-bit word.
  assert not tpu_kernel_fits(q128, pool(3))  # 6 key and value heads: no tiling.
  assert not tpu_kernel_fits(jnp.zeros((1, 1, 4, 64)), pool(2))


def test_the_tpu_kernel_is_refused_off_tpus_where_interpret_mode_cannot_run_it():
  """Named on this CPU, a clear error. JAX's own TPU interpret mode still fails inside the
  kernel (if a pinned JAX runs it one day, this fails: then check the kernel itself here
  as the GPU one is, and drop the refusal)."""
  positions = np.asarray([[5], [9]], np.int32)
  pool, tables, _ = _pool_and_tables(positions, width=4)
  pools = [jnp.asarray(np.repeat(p, 16, axis=-1)) for p in pool]  # head_dim 128.
  q = jnp.asarray(RNG.normal(size=(2, 1, HEADS, 128)).astype(np.float32))
  assert tpu_kernel_fits(q, pools[0])
  with pytest.raises(ValueError, match="'pallas_tpu' runs on TPUs only, not cpu: JAX .*'s TPU "
                                       "interpret mode cannot run"):
    paged_attention(q, *pools, jnp.asarray(tables), jnp.asarray(positions), scale=0.3,
                    implementation="pallas_tpu")
  kernel = functools.partial(ragged.ragged_paged_attention, num_kv_pages_per_block=2,
                             num_queries_per_block=2)  # Off TPUs it has no tuned sizes.
  failed = (AttributeError, jax.errors.JaxRuntimeError)  # Raised inside a callback, or not.
  with pltpu.force_tpu_interpret_mode(), pytest.raises(failed, match="ReshapeTransform"):
    jax.block_until_ready(pallas_tpu(q, *fuse_pages(*pools, jnp.asarray(tables)),
                                     jnp.asarray(positions), scale=0.3, kernel=kernel))


def test_auto_picks_the_pallas_kernels_on_gpu_and_tpu_and_an_unknown_name_is_named():
  assert choose_paged_attention("auto", "gpu")[0] == "pallas_gpu"
  assert choose_paged_attention("auto", "tpu")[0] == "pallas_tpu"
  assert choose_paged_attention("auto", "tpu", "TPU v5 lite")[0] == "pallas_tpu"
  name, why = choose_paged_attention("auto", "tpu", "TPU v3")
  assert name == "xla" and "TPU v4 and newer only" in why
  assert choose_paged_attention("auto", "cpu")[0] == "xla"
  with pytest.raises(ValueError, match="unknown paged attention 'flash'; choose auto or one of "
                                       "pallas_gpu, pallas_tpu, xla"):
    choose_paged_attention("flash")


def test_a_plan_chooses_the_paged_attention_for_its_backend_and_the_model_decodes_with_it():
  """Not at trace time on the host: a model built for a TPU slice's devices decodes with
  the TPU kernel, here on a CPU with the xla loop."""
  tpu = kernels.Backend("tpu", "TPU v5 lite")
  plan = kernels.AttentionPlan(("xla",), "a test", backend=tpu)
  assert plan.paged_attention()[0] == "pallas_tpu"
  assert kernels.AttentionPlan(("xla",), "a test").paged_attention()[0] == "xla"  # This CPU.
  named = kernels.AttentionPlan(("xla",), "a test", backend=tpu, paged="xla")
  assert named.paged_attention() == ("xla", "requested: a loop over the pages with an online "
                                            "softmax, in XLA")
  assert kernels.AttentionPlan.from_dict(named.to_dict()).paged == "xla"
  assert kernels.AttentionPlan.from_dict({"order": ["xla"], "source": "old"}).paged == "auto"
  with pytest.raises(ValueError, match="unknown paged attention 'flash'"):
    kernels.AttentionPlan(("xla",), "a test", paged="flash")
  decoder = Decoder(DecoderConfig.tiny(num_layers=1), rngs=nnx.Rngs(0), attention=plan)
  chosen = {m._paged_attention() for _, m in nnx.iter_graph(decoder)  # pylint: disable=protected-access
            if isinstance(m, layers.Attention)}
  assert chosen == {"pallas_tpu"}


def test_the_tpu_kernel_s_block_sizes_are_its_own_table_s_for_the_chip_compiled_for():
  """JAX's kernel looks its block sizes up for this machine's device; the adapter looks
  them up for the target's: (pages, queries) a block, capped by the table width."""
  key = ("bfloat16", "bfloat16", 32, 8, 128, 16, 32, 512)
  pages, queries = tuned_block_sizes.TUNED_BLOCK_SIZES["TPU v5"].get(key, (128, 32))
  assert paged_tpu.tpu_block_sizes((32, 32, 128), (1025, 16, 16, 128), 32, jnp.bfloat16,
                               "TPU v5 lite") == (min(32, pages), min(32, queries))
  assert paged_tpu.tpu_block_sizes((8, 8, 128), (65, 16, 4, 128), 8, jnp.bfloat16,
                               "TPU v4") == (8, 8)  # v4: (32, 32) untuned, capped.
  # 2048 positions a row: the untuned block of 128 pages would take 16 MiB of scoped VMEM
  # double-buffered (a v5e has 16 MiB in all); the pages are halved until they fit.
  pages, _ = paged_tpu.tpu_block_sizes((32, 32, 128), (4097, 16, 16, 128), 128, jnp.bfloat16,
                                   "TPU v5 lite")
  assert 2 * pages * 16 * 16 * 128 * 2 <= paged_tpu.KV_BLOCK_VMEM and pages == 64
