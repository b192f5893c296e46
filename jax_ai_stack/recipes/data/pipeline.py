"""`build_dataset`: a deterministic, sharded, checkpointable Grain pipeline.

The pipeline is `grain.MapDataset.range(num_steps).map(StepBatches(...))`,
turned into an `IterDataset` that builds batches ahead in one background
thread (`ThreadPrefetchIterDataset`), or in `num_workers` processes
(`mp_prefetch`). Element s of the range is global step s; `StepBatches`
computes which examples step s holds with integer arithmetic, then gathers
them in one vectorized call:

* Order. The train stream is endless: its position g is example
  `permutation(seed, epoch)[g % n]` with `epoch = g // n`, so the order is a
  pure function of (seed, epoch, index) and each epoch is reshuffled. The
  permutation sorts a SplitMix64 hash of (seed, epoch, example), integer
  arithmetic that gives the same order on every machine and NumPy version.
  Validation is one pass in corpus order, no shuffle.
* Sharding. Global step s covers stream positions [s*B, (s+1)*B); process p of
  P reads the contiguous block [s*B + p*B/P, s*B + (p+1)*B/P). The processes'
  batches, concatenated in process order, are exactly the global batch.
* Validation drops the remainder: it yields `n // B` full batches (the same
  count on every process), so the last `n % B` examples are not evaluated.
* State. An iterator's state is Grain's own (`{"next_index": s}` without
  workers: the position after the batch last returned, whatever was
  prefetched), so `get_state`/`set_state` and `grain.checkpoint.CheckpointSave`
  / `CheckpointRestore` in an Orbax `CheckpointManager` resume at the exact
  batch.
* Workers only split the range of steps between them, and Grain interleaves
  their outputs in order: a pipeline yields the same batches with any
  `num_workers`.

Why not `MapDataset.shuffle(...).batch(...)`: those run Python per example
(about 10-20 us each here); a vectorized batch costs about as much as one
example.

Worker processes (`num_workers > 0`) are started with `spawn`, which re-imports
the main module: scripts must create and iterate the dataset under
`if __name__ == "__main__":`. Close iterators you are done with
(`iterator.close()`) so workers and shared memory are released.
"""

from __future__ import annotations

import functools
import sys
from typing import Literal

import grain
import numpy as np

from jax_ai_stack.absl_flags import ensure_absl_flags_parsed
from jax_ai_stack.recipes.data import corpus as corpus_lib
from jax_ai_stack.recipes.data import examples as examples_lib
from jax_ai_stack.recipes.data import sources
from jax_ai_stack.recipes.data.config import DataConfig
from jax_ai_stack.recipes.data.tokenizers import build_tokenizer

Split = Literal["train", "validation"]
_MASK64 = (1 << 64) - 1
# Arrays smaller than this travel from workers by pickling, not shared memory:
# cheaper for small batches, and the outputs stay plain `np.ndarray`.
_MIN_SHARED_MEMORY_BYTES = 1 << 20


def _mix64(x: np.ndarray) -> np.ndarray:
  """SplitMix64's finalizer on uint64: a fixed bijective hash (wraps mod 2**64)."""
  with np.errstate(over="ignore"):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def hash_uniform(values: np.ndarray, salt: int) -> np.ndarray:
  """float64 in [0, 1) per integer in `values`, fixed by (value, salt)."""
  key = _mix64(np.array([salt & _MASK64], dtype=np.uint64))
  with np.errstate(over="ignore"):
    hashed = _mix64(np.asarray(values).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ key)
  return (hashed >> np.uint64(11)).astype(np.float64) / 2.0**53


@functools.lru_cache(maxsize=4)
def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """The example order of one epoch: a pure function of (num_examples, seed, epoch)."""
  salt = int(_mix64(np.array([seed & _MASK64], dtype=np.uint64))[0]) ^ epoch
  keys = hash_uniform(np.arange(num_examples), salt)
  order = np.argsort(keys, kind="stable")
  order.flags.writeable = False
  return order


class StepBatches:
  """Global step s -> this process's batch; the function `MapDataset.map` applies.

  Holds no mutable state, so it pickles to worker processes and a restored
  iterator recomputes exactly the batches it would have produced.
  """

  def __init__(self, examples, *, global_batch: int, process_index: int,
               process_count: int, seed: int | None):
    self.examples = examples
    self.global_batch = global_batch
    self.local_batch = global_batch // process_count
    self.process_index = process_index
    self.process_count = process_count
    self.seed = seed  # None: one pass in order, no shuffle

  def example_ids(self, step: int) -> np.ndarray:
    """Example ids of this process's rows of global step `step`."""
    n = self.examples.num_examples
    position = step * self.global_batch + self.process_index * self.local_batch
    end = position + self.local_batch
    pieces = []
    while position < end:  # consecutive positions: one slice per epoch touched
      epoch, offset = divmod(position, n)
      take = min(end - position, n - offset)
      if self.seed is None:
        pieces.append(np.arange(offset, offset + take))
      else:
        pieces.append(epoch_permutation(n, self.seed, epoch)[offset:offset + take])
      position += take
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

  def __call__(self, step) -> dict[str, np.ndarray]:
    return self.examples(self.example_ids(int(step)))

  def __repr__(self) -> str:
    # Stable across runs and processes (no addresses): Grain logs it, and
    # `grain.DataLoader` compares such reprs when restoring state.
    return (
        f"StepBatches({self.examples!r}, global_batch={self.global_batch},"
        f" process={self.process_index}/{self.process_count}, seed={self.seed})"
    )


def _examples(config: DataConfig, split: Split):
  if config.source == "digits":
    images, labels = sources.load_digits()
    held_out = hash_uniform(np.arange(len(labels)), salt=0) < config.holdout_fraction
    keep = held_out if split == "validation" else ~held_out
    return examples_lib.DigitsExamples(images[keep], labels[keep], split)
  corpus = corpus_lib.load_corpus(config)[split]
  if corpus.num_documents == 0:
    raise ValueError(
        f"data: the {split} split is empty: {corpus!r}; every document hashed to the"
        f" other side at data.validation_fraction={config.holdout_fraction}; add"
        " documents or change data.validation_fraction"
    )
  if config.packing:
    return examples_lib.LMPacked(corpus, config.seq_len, build_tokenizer(config).pad_id)
  return examples_lib.LMWindows(corpus, config.seq_len)


def _process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top

    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} is not in [0, {process_count})")
  return process_index, process_count


def build_dataset(
    config: DataConfig,
    *,
    split: Split,
    seed: int,
    process_index: int | None = None,
    process_count: int | None = None,
) -> grain.IterDataset:
  """This process's batches of `split`, as a Grain `IterDataset`.

  Args:
    config: what to read and how to batch it.
    split: "train" (endless, reshuffled every epoch) or "validation" (one pass
      in order, `num_examples // batch_size` full batches).
    seed: the train order; any int (validation ignores it).
    process_index: this host's index; default `jax.process_index()`.
    process_count: number of hosts; default `jax.process_count()`.

  Returns:
    An `IterDataset` of dicts of NumPy arrays with
    `config.batch_size // process_count` rows (see `examples` for the keys).
    `iter(ds)` is a `grain.DatasetIterator` with `get_state`/`set_state`.

  Raises:
    ValueError: bad data or sizes; the message names the field or file.
  """
  if split not in ("train", "validation"):
    raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
  process_index, process_count = _process(process_index, process_count)
  if config.batch_size % process_count:
    raise ValueError(
        f"data.batch_size={config.batch_size} is not divisible by the"
        f" process_count={process_count}"
    )
  examples = _examples(config, split)
  if split == "train":
    num_steps = sys.maxsize
  else:
    num_steps = examples.num_examples // config.batch_size
    if num_steps == 0:
      raise ValueError(
          f"data: the validation split has {examples.num_examples} examples, fewer than"
          f" one global batch (data.batch_size={config.batch_size})"
      )
  batches = StepBatches(
      examples,
      global_batch=config.batch_size,
      process_index=process_index,
      process_count=process_count,
      seed=seed if split == "train" else None,
  )
  ds = grain.MapDataset.range(num_steps).map(batches)
  # Batches are built whole in one call: Grain's per-element thread pool would
  # only add overhead, so read synchronously and prefetch one batch stream.
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  # Grain's mp_prefetch reads an absl flag and fails with UnparsedFlagAccessError
  # outside absl.app.run; done here for all, also users adding their own workers.
  ensure_absl_flags_parsed()
  if config.num_workers:
    options = grain.experimental.DatasetOptions(min_shm_size=_MIN_SHARED_MEMORY_BYTES)
    ds = grain.experimental.WithOptionsIterDataset(ds, options)
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=config.num_workers,
        per_worker_buffer_size=max(config.prefetch_batches, 1),
    ))
  elif config.prefetch_batches:
    ds = grain.experimental.ThreadPrefetchIterDataset(
        ds, prefetch_buffer_size=config.prefetch_batches)
  return ds
