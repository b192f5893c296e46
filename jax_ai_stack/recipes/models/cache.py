"""A layer's cache for decoding: what it allocates (a spec it owns), and how it is laid out.

Each attention layer says what it keeps between decoding calls with `cache_spec`: named
arrays (`CacheArray`), each either paged (a pool of pages shared by the slots through their
block tables: keys and values, or a compressed latent) or per slot (a fixed-size state a
request overwrites as it goes: a recurrent layer's). The decoder lays every layer's arrays
out from those specs (`lay_out`: `Decoder.init_pages` for the engine, `Decoder.init_cache`
for one contiguous row per sequence) and places them (`shardings`); the engine holds the
result as one opaque pytree and passes it through its compiled calls, and resets a slot's
per-slot arrays when it admits a request there (`reset_slot`; a paged array needs no reset:
its slot's block table names only the pages it writes). So a new kind of layer state is a
new spec, not a change to the engine.

A layer's cache is a dict {name: array}; the model's is a tuple of them, one per layer, or
one dict of arrays stacked [num_layers, ...] when the layers are (`scan_layers`). With
replicas (a data-parallel engine, `Decoder.page_replicas`) every array has a replica axis
just before its PAGES or SLOTS dimension, and replica r's part is its own pool of pages or
its own slots.

Example: a per-slot state of 3 features, for 2 replicas of 4 slots.
  >>> spec = {"state": CacheArray((SLOTS, 3), "float32")}
  >>> state = lay_out([spec], {SLOTS: 4}, replicas=2, stacked=False)
  >>> state[0]["state"].shape
  (2, 4, 3)
  >>> state = reset_slot([spec], jax.tree.map(jnp.ones_like, state), 1, 2, stacked=False)
  >>> float(state[0]["state"].sum())  # 24 ones, 3 of them zeroed.
  21.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

PAGES, PAGE_SIZE, SLOTS, LENGTH = "pages", "page_size", "slots", "length"
"""The dimensions whose sizes the caller gives (`lay_out`'s `sizes`): a pool's pages and
positions per page, the slots of per-slot state, a contiguous cache's positions per row."""
HEADS = "heads"
"""A dimension split over the mesh like the attention's heads (`CacheArray.axes`)."""


@dataclasses.dataclass(frozen=True)
class CacheArray:
  """One array of a layer's cache: its shape, dtype and which dimension a mesh splits.

  `shape` holds sizes and the names PAGES, PAGE_SIZE, SLOTS and LENGTH, which the caller
  sizes: an array with PAGES is paged (the engine's pool), one with SLOTS is per slot (reset
  when a request is admitted to the slot; the engine's rows read it through
  `KVCache.slots`). A per-slot array's SLOTS dimension comes first (`slot_rows`).
  """

  shape: tuple[int | str, ...]
  dtype: str
  axes: tuple[str | None, ...] = ()
  """Per dimension, HEADS where the mesh splits it like the attention's heads (where they
  divide), else None; () for none."""

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(self.shape))
    object.__setattr__(self, "axes", tuple(self.axes) or (None,) * len(self.shape))
    if len(self.axes) != len(self.shape):
      raise ValueError(f"axes {self.axes} do not name the {len(self.shape)} dimensions of "
                       f"{self.shape}")
    if self.per_slot and self.shape.index(SLOTS) != 0:
      raise ValueError(f"a per-slot array's SLOTS dimension comes first; got {self.shape}")

  @property
  def per_slot(self) -> bool:
    """Whether it holds a state per slot (reset at admission) rather than pages."""
    return SLOTS in self.shape

  def sized(self, sizes: Mapping[str, int], replicas: int = 1) -> tuple[int, ...]:
    """Its shape with the named dimensions sized, and with more than one replica the
    replica axis before the PAGES or SLOTS dimension (`replica_axis`)."""
    shape = [sizes[d] if isinstance(d, str) else d for d in self.shape]
    if replicas > 1:
      shape.insert(self.replica_axis(), replicas)
    return tuple(shape)

  def replica_axis(self) -> int:
    """Where the replica axis goes: before the first PAGES, SLOTS or LENGTH dimension."""
    return next(i for i, d in enumerate(self.shape) if d in (PAGES, SLOTS, LENGTH))

  def bytes(self, sizes: Mapping[str, int]) -> int:
    """Its size in bytes for `sizes` (one replica)."""
    count = 1
    for d in self.sized(sizes):
      count *= d
    return count * jnp.dtype(self.dtype).itemsize


Spec = Mapping[str, CacheArray]
"""A layer's cache spec: its arrays by name (an attention module's `cache_spec`)."""


class KVCache(NamedTuple):
  """Every layer's cache (`state`) and where the rows stand in it.

  `state` is opaque to the callers: each layer reads and writes its own entry (laid out by
  `lay_out` from its spec), a tuple with one dict per layer, or with `scan_layers` one dict
  of stacked arrays [num_layers, ...]. A layer's call gets a KVCache whose `state` is its
  own dict. The first `length` positions are filled.
  """

  state: tuple[dict[str, jax.Array], ...] | dict[str, jax.Array]
  length: jax.Array
  """int32: a scalar (every row holds as many tokens), or [B], one per row, with a
  `block_table` only."""
  block_table: jax.Array | None = None
  """Paged (the generation engine's): int32 [B, W], row b's positions j * page_size ... in
  page block_table[b, j] of each paged array; `length` is [B]: row i's T tokens go to
  positions length[i] ... (a chunk of its prompt, or one). With replicas the rows are R
  equal groups in order, group r's table numbering the pages of pool r
  (`Decoder.init_pages`)."""
  slots: jax.Array | None = None
  """Paged: int32 [B], the slot (of its replica) whose per-slot arrays row b reads and
  writes; an idle row's is past the last slot, and it reads zeros and writes nothing
  (`slot_rows`). None: row b is slot b (a contiguous cache, or rows that are the slots)."""
  valid: jax.Array | None = None
  """int32 [B]: how many of row b's T tokens are its own, the rest padding a prompt's chunk
  (the engine's prefill); a per-slot state must not take the rest in (their pages are
  written over later, a recurrent state cannot be). None: all T."""


def lay_out(specs: Sequence[Spec], sizes: Mapping[str, int], replicas: int = 1, *,
            stacked: bool):
  """Zeros for every layer's spec (`specs`, one per layer; a stacked model's are equal):
  a tuple of dicts, or with `stacked` one dict of [len(specs), ...] arrays. Each is a
  buffer of its own (not one shared by keys and values), so a compiled call may donate
  them all."""
  zeros = lambda a, lead=(): jnp.zeros((*lead, *a.sized(sizes, replicas)), jnp.dtype(a.dtype))
  if stacked:
    return {name: zeros(a, (len(specs),)) for name, a in specs[0].items()}
  return tuple({name: zeros(a) for name, a in spec.items()} for spec in specs)


def shardings(specs: Sequence[Spec], mesh, batch: tuple[str, ...], heads: tuple[str, ...],
              heads_split: int, *, stacked: bool):
  """Where `lay_out`'s arrays of several replicas live (a pytree like its): the replica
  axis over the mesh's `batch` axes, each HEADS dimension over `heads` where its size
  divides by `heads_split` (their size), the rest whole."""
  def place(array: CacheArray) -> NamedSharding:
    spec = [heads if axis == HEADS and size % heads_split == 0 else None
            for size, axis in zip(array.shape, array.axes)]
    spec.insert(array.replica_axis(), batch)
    spec = [None] * stacked + [s or None for s in spec]
    while spec and spec[-1] is None:  # As short as it can be: P('tensor', ('data',)).
      spec.pop()
    return NamedSharding(mesh, P(*spec))

  if stacked:
    return {name: place(a) for name, a in specs[0].items()}
  return tuple({name: place(a) for name, a in spec.items()} for spec in specs)


def reset_slot(specs: Sequence[Spec], state, replica, slot, *, stacked: bool):
  """`state` (`lay_out`'s) with slot `slot` of replica `replica` zeroed in every per-slot
  array (the engine's admission of a request); paged arrays as they are."""
  def reset(array: CacheArray, value: jax.Array) -> jax.Array:
    if not array.per_slot:
      return value
    index = [slice(None)] * value.ndim
    axis = stacked + array.replica_axis()
    if value.ndim > stacked + len(array.shape):  # A replica axis before SLOTS.
      index[axis], axis = replica, axis + 1
    index[axis] = slot
    return value.at[tuple(index)].set(0)

  if stacked:
    return {name: reset(a, state[name]) for name, a in specs[0].items()}
  return tuple({name: reset(a, layer[name]) for name, a in spec.items()}
               for spec, layer in zip(specs, state))


def replicated(spec: Spec, state: Mapping[str, jax.Array]) -> bool:
  """Whether a layer's `state` has a replica axis (`lay_out` with replicas > 1)."""
  name, array = next(iter(spec.items()))
  return state[name].ndim > len(array.shape)


def slot_rows(array: jax.Array, slots: jax.Array | None) -> jax.Array:
  """Each row's entry of a per-slot `array` [slots, ...] (one replica's): [B, ...]; zeros
  for an idle row (a slot past the last). `slots` None: the rows are the slots."""
  if slots is None:
    return array
  return jnp.take(array, slots, axis=0, mode="fill", fill_value=0)


def put_slot_rows(array: jax.Array, slots: jax.Array | None, rows: jax.Array) -> jax.Array:
  """`array` [slots, ...] with each row's entry `rows` [B, ...] written at its slot; an
  idle row's (a slot past the last) is dropped."""
  if slots is None:
    return rows.astype(array.dtype)
  return array.at[slots].set(rows.astype(array.dtype), mode="drop")


def copy_pages(specs: Sequence[Spec], state, replica, sources, targets, *, stacked: bool):
  """`state` (`lay_out`'s) with pages `sources` of replica `replica`'s pool copied to pages
  `targets` (int32 [n] each) in every paged array: a prompt's keys and values shared by
  requests with the same prompt (the engine's). Per-slot arrays as they are."""
  def copy(array: CacheArray, value: jax.Array) -> jax.Array:
    if array.per_slot:
      return value
    axis = stacked + array.shape.index(PAGES)  # The replica axis, if any, is here too.
    if value.ndim == stacked + len(array.shape):
      return _copied(value, axis, sources, targets)
    pool = _copied(jnp.take(value, replica, axis=axis), axis, sources, targets)
    index = [slice(None)] * value.ndim
    index[axis] = replica
    return value.at[tuple(index)].set(pool)

  if stacked:
    return {name: copy(a, state[name]) for name, a in specs[0].items()}
  return tuple({name: copy(a, layer[name]) for name, a in spec.items()}
               for spec, layer in zip(specs, state))


def _copied(value: jax.Array, axis: int, sources: jax.Array, targets: jax.Array) -> jax.Array:
  """`value` with its slices `sources` along `axis` written at `targets`."""
  moved = jnp.moveaxis(value, axis, 0)
  return jnp.moveaxis(moved.at[targets].set(moved[sources]), 0, axis)
