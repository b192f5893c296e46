"""A layer's cache as a spec it owns (`models.cache`): laid out, placed and reset from the
spec alone, and threaded through the engine without the engine knowing what it holds.

The toy layer here keeps, beside its keys and values, a per-slot state the way a recurrent
layer keeps its own (a fixed size per slot, read and written by the slot's rows, never
paged): how many tokens its slot has taken in."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.recipes.inference import Engine, Request
from jax_ai_stack.recipes.models import cache as cache_lib
from jax_ai_stack.recipes.models import eager_sharding_scope
from jax_ai_stack.recipes.models.cache import SLOTS, CacheArray, KVCache
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig
from jax_ai_stack.recipes.models.layers import Attention, per_replica

SEEN = CacheArray((SLOTS, 1), "int32")


class CountingAttention(Attention):
  """Attention whose cache also counts, per slot, the tokens the slot has taken in."""

  def cache_spec(self, paged=True):
    return {**super().cache_spec(paged), "seen": SEEN}

  def __call__(self, x, rope, segment_ids=None, cache=None):
    if cache is None:
      return super().__call__(x, rope, segment_ids)
    kv = {name: cache.state[name] for name in ("keys", "values")}
    out, state = super().__call__(x, rope, segment_ids, cache._replace(state=kv))
    valid = (jnp.full((x.shape[0],), x.shape[1], jnp.int32) if cache.valid is None
             else cache.valid)

    def count(rows, state):  # One replica's rows and slots.
      valid, slots = rows
      seen = cache_lib.slot_rows(state["seen"], slots) + valid[:, None]
      return valid, {"seen": cache_lib.put_slot_rows(state["seen"], slots, seen)}

    seen, spec = {"seen": cache.state["seen"]}, {"seen": SEEN}
    if cache_lib.replicated(spec, seen):
      _, seen = per_replica(count, self.attention_sharding, spec, (valid, cache.slots), seen)
    else:
      _, seen = count((valid, cache.slots), seen)
    return out, {**state, **seen}


def counting_model(layer: int = 1) -> Decoder:
  """The tiny decoder with layer `layer`'s attention a counting one."""
  config = DecoderConfig.tiny(num_layers=2)
  model = Decoder(config, rngs=nnx.Rngs(0))
  plan = model.layers[layer].attention.attention_plan
  with eager_sharding_scope():  # No mesh: the parameters' axis names stay metadata.
    model.layers[layer].attention = CountingAttention(config, plan, rngs=nnx.Rngs(1),
                                                      layer=layer)
  return model


def test_init_pages_lays_out_each_layer_s_spec_paged_and_per_slot():
  model = counting_model()
  plain, counting = model.init_pages(5, 8, slots=3)
  assert set(plain) == {"keys", "values"} and set(counting) == {"keys", "values", "seen"}
  assert counting["keys"].shape == (2, 5, 8, 32)  # [K, pages, page_size, H]
  assert counting["seen"].shape == (3, 1) and counting["seen"].dtype == jnp.int32
  two = model.init_pages(5, 8, 2, slots=3)[1]  # A replica axis before pages and slots.
  assert two["keys"].shape == (2, 2, 5, 8, 32) and two["seen"].shape == (2, 3, 1)
  assert model.page_bytes(8) == (2 * 2 * 2 * 8 * 32 * 4, 4)  # Two layers' K and V; 1 int.
  assert Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0)).page_bytes(8)[1] == 0


def test_the_engine_threads_a_per_slot_state_and_admission_empties_that_slot_alone():
  """Each slot's count is what its last request fed: its prompt, then each sampled token
  but the last (idle rows and a prompt chunk's padding add nothing). A request admitted to a
  used slot starts from zero (the reset); the other slot keeps its count."""
  model = counting_model()
  engine = Engine(model, max_slots=2, max_len=64, page_size=8, steps_per_call=1,
                  prefill_chunk=16)
  seen = lambda: np.asarray(engine._cache[1]["seen"][:, 0])  # pylint: disable=protected-access
  first = [Request(tuple(range(1, 6)), 3, temperature=0),  # Slot 0: 5 + 3 - 1.
           Request(tuple(range(1, 21)), 6, temperature=0)]  # Slot 1: two chunks, 20 + 5.
  engine.run(first)
  assert seen().tolist() == [7, 25]
  assert np.asarray(engine._cache[0]["keys"]).any()  # pylint: disable=protected-access
  engine.run([Request((7, 8, 9), 2, temperature=0)])  # Slot 0 again: 3 + 1, from zero.
  assert seen().tolist() == [4, 25]


def test_decode_without_the_engine_counts_each_row_and_each_replica_apart():
  """The per-slot state through `Decoder.decode` over pools of two replicas (rows 0-1 in
  replica 0, rows 2-3 in replica 1, as `per_replica` splits them) and a contiguous cache."""
  model = counting_model()
  tokens = jnp.ones((4, 3), jnp.int32)
  table = jnp.asarray([[1], [2], [1], [2]], jnp.int32)
  slots = jnp.asarray([1, 2, 0, 2], jnp.int32)  # Row 1: an idle row (past the last slot).
  paged = KVCache(model.init_pages(3, 8, 2, slots=2), jnp.zeros(4, jnp.int32), table, slots,
                  valid=jnp.asarray([3, 2, 1, 3], jnp.int32))
  _, paged = model.decode(tokens, paged)
  np.testing.assert_array_equal(paged.state[1]["seen"][..., 0], [[0, 3], [1, 0]])
  _, contiguous = model.decode(tokens, model.init_cache(4, 16))
  np.testing.assert_array_equal(contiguous.state[1]["seen"][:, 0], [3, 3, 3, 3])


@pytest.mark.parametrize("stacked", [False, True], ids=["per layer", "stacked"])
def test_reset_slot_zeroes_one_slot_of_one_replica_and_leaves_pages(stacked):
  specs = [{"keys": CacheArray((2, cache_lib.PAGES, cache_lib.PAGE_SIZE, 4), "float32"),
            "seen": CacheArray((SLOTS, 3), "float32")}] * 2
  state = cache_lib.lay_out(specs, {cache_lib.PAGES: 3, cache_lib.PAGE_SIZE: 2, SLOTS: 4}, 2,
                        stacked=stacked)
  state = jax.tree.map(jnp.ones_like, state)
  state = cache_lib.reset_slot(specs, state, 1, 2, stacked=stacked)
  layers = [state] if stacked else list(state)
  for layer in layers:
    assert float(layer["keys"].min()) == 1.0
    seen = np.asarray(layer["seen"]).reshape(-1, 2, 4, 3)  # [layers, replicas, slots, 3]
    assert (seen[:, 1, 2] == 0).all() and seen.sum() == seen.size - 3 * seen.shape[0]


def test_shardings_put_replicas_over_the_batch_axes_and_heads_where_they_divide():
  mesh = jax.sharding.AbstractMesh((2, 2), ("data", "tensor"))
  specs = [{"keys": CacheArray((2, cache_lib.PAGES, cache_lib.PAGE_SIZE, 4), "float32",
                               (cache_lib.HEADS, None, None, None)),
            "latent": CacheArray((cache_lib.PAGES, cache_lib.PAGE_SIZE, 3, 6), "float32",
                                 (None, None, cache_lib.HEADS, None)),
            "seen": CacheArray((SLOTS, 3), "float32")}]
  placed = cache_lib.shardings(specs, mesh, ("data",), ("tensor",), 2, stacked=False)[0]
  assert str(placed["keys"].spec) == "P('tensor', 'data')"
  assert str(placed["latent"].spec) == "P('data',)"  # 3 heads do not split over 2.
  assert str(placed["seen"].spec) == "P('data',)"
  stacked = cache_lib.shardings(specs, mesh, ("data",), ("tensor",), 2, stacked=True)
  assert str(stacked["keys"].spec) == "P(None, 'tensor', 'data')"
  with pytest.raises(ValueError, match="SLOTS dimension comes first"):
    CacheArray((3, SLOTS), "float32")


@pytest.mark.parametrize("replicas, stacked", [(1, False), (2, False), (2, True)])
def test_copy_pages_copies_a_replica_s_pages_and_nothing_else(replicas, stacked):
  """What the engine does for requests that share a prompt: pages 1, 2 of a pool copied to
  pages 3, 4, in one replica's pool alone; a per-slot array is left as it is."""
  spec = {"keys": cache_lib.CacheArray((2, cache_lib.PAGES, cache_lib.PAGE_SIZE, 3), "float32"),
          "state": cache_lib.CacheArray((cache_lib.SLOTS, 3), "float32")}
  sizes = {cache_lib.PAGES: 6, cache_lib.PAGE_SIZE: 4, cache_lib.SLOTS: 2}
  state = cache_lib.lay_out([spec, spec], sizes, replicas, stacked=stacked)
  state = jax.tree.map(lambda a: jnp.arange(a.size, dtype=a.dtype).reshape(a.shape), state)
  copied = cache_lib.copy_pages([spec, spec], state, replicas - 1, jnp.array([1, 2]),
                                jnp.array([3, 4]), stacked=stacked)
  layers = [copied] if stacked else list(copied)
  before = [state] if stacked else list(state)
  for old, new in zip(before, layers):
    keys, was = np.asarray(new["keys"]), np.asarray(old["keys"])
    np.testing.assert_array_equal(new["state"], old["state"])
    pool = (slice(None),) * stacked + (slice(None),) + ((replicas - 1,) if replicas > 1 else ())
    np.testing.assert_array_equal(keys[pool][..., 3:5, :, :], was[pool][..., 1:3, :, :])
    untouched = np.ones(keys.shape, bool)
    untouched[pool + (slice(3, 5),)] = False
    np.testing.assert_array_equal(keys[untouched], was[untouched])
