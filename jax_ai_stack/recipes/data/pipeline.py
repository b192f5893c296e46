"""`build_dataset`: a deterministic, sharded, checkpointable Grain pipeline.

The pipeline is `grain.MapDataset.range(num_steps).map(StepBatches(...))`,
turned into an `IterDataset` that builds batches ahead in one background
thread (`ThreadPrefetchIterDataset`), or in `num_workers` processes
(`mp_prefetch`). Element s of the range is global step s; `StepBatches`
computes which examples step s holds with integer arithmetic, then gathers
them in one vectorized call:

* Order. The train stream is endless: its position g is example
  `permute(g % n, n, seed, epoch)` with `epoch = g // n`, so the order is a
  pure function of (seed, epoch, index) and each epoch is reshuffled.
  `permutation.permute` is a stateless Feistel permutation computed per
  position (O(1) memory, no sort; about 50 us for a batch of 8 to a few
  hundred positions), integer arithmetic that gives the same order on every
  machine and NumPy version. Validation is one pass in corpus order, no shuffle.
* Sharding. Global step s covers stream positions [s*B, (s+1)*B); process p of
  P reads the contiguous block [s*B + p*B/P, s*B + (p+1)*B/P). The processes'
  batches, concatenated in process order, are exactly the global batch. With
  `data.batch_schedule` the sizes change at named steps and s*B becomes
  `BatchSchedule.first_row(s)`: the stream is still read in order.
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
`if __name__ == "__main__":`. An `mp_prefetch` of your own on top, outside
`absl.app.run`, needs `jax_ai_stack.absl_flags.grain_flags_readable()` first
(grain reads an absl flag there). Close iterators you are done with
(`iterator.close()`, or `with contextlib.closing(iter(ds)) as iterator:`) so
the prefetch thread, workers and shared memory are released at once. Those
still open when the interpreter exits are closed by an `atexit` hook
(`grain_exit`).

Example: step batches over an in-memory token array, then a pipeline over a
.npy file that resumes from its saved state.
  >>> import contextlib
  >>> from jax_ai_stack.recipes.data.corpus import TokenCorpus
  >>> from jax_ai_stack.recipes.data.examples import LMWindows
  >>> corpus = TokenCorpus(np.arange(100) % 50, np.array([0, 100]), "0..49 twice")
  >>> batches = StepBatches(LMWindows(corpus, seq_len=8), global_batch=4, process_index=0,
  ...                       process_count=1, seed=0)
  >>> batches.example_ids(0).tolist(), batches.example_ids(3).tolist()  # Step 3: epoch 2.
  ([9, 4, 10, 6], [0, 6, 10, 4])
  >>> grain.MapDataset.range(10).map(batches)[0]["inputs"][0].tolist()
  [22, 23, 24, 25, 26, 27, 28, 29]
  >>> np.save("tokens.npy", np.arange(1000, dtype=np.int32) % 250)
  >>> config = DataConfig(source="npy", paths=("tokens.npy",), seq_len=8, batch_size=4)
  >>> ds = build_dataset(config, split="train", seed=0, process_index=0, process_count=1)
  >>> with contextlib.closing(iter(ds)) as iterator:
  ...   first, state, second = next(iterator), iterator.get_state(), next(iterator)
  >>> first["inputs"].shape, state
  ((4, 8), {'next_index': 1})
  >>> with contextlib.closing(iter(ds)) as iterator:
  ...   iterator.set_state(state)
  ...   bool((next(iterator)["inputs"] == second["inputs"]).all())
  True
"""

from __future__ import annotations

import math
import sys
import zlib
from typing import Literal

import grain
import numpy as np

from jax_ai_stack.absl_flags import grain_flags_readable
from jax_ai_stack.errors import ConfigError, DataError
from jax_ai_stack.recipes.data import chat, preference, prompts
from jax_ai_stack.recipes.data import corpus as corpus_lib
from jax_ai_stack.recipes.data import examples as examples_lib
from jax_ai_stack.recipes.data import mixture as mixture_lib
from jax_ai_stack.recipes.data import sources
from jax_ai_stack.recipes.data.batch_schedule import BatchSchedule
from jax_ai_stack.recipes.data.config import DataConfig
from jax_ai_stack.recipes.data.corpora import load_corpus
from jax_ai_stack.recipes.data.grain_exit import ClosedAtExit
from jax_ai_stack.recipes.data.permutation import hash_uniform, permute
from jax_ai_stack.recipes.data.tokenizers import build_tokenizer

Split = Literal["train", "validation"]
# Arrays smaller than this travel from workers by pickling, not shared memory:
# cheaper for small batches, and the outputs stay plain `np.ndarray`.
_MIN_SHARED_MEMORY_BYTES = 1 << 20


class StepBatches:
  """Global step s -> this process's batch; the function `MapDataset.map` applies.

  `global_batch` is the rows of every step, or a `BatchSchedule` (`data.batch_schedule`)
  whose sizes change at named steps; the stream's rows are read in order either way.
  Holds no mutable state, so it pickles to worker processes and a restored
  iterator recomputes exactly the batches it would have produced.
  """

  def __init__(self, examples, *, global_batch: int | BatchSchedule, process_index: int,
               process_count: int, seed: int | None):
    self.examples = examples
    self.schedule = _schedule(global_batch)
    self.process_index = process_index
    self.process_count = process_count
    self.seed = seed  # None: one pass in order, no shuffle

  def example_ids(self, step: int) -> np.ndarray:
    """Example ids of this process's rows of global step `step`."""
    n = self.examples.num_examples
    positions = _process_rows(self.schedule, step, self.process_index, self.process_count)
    return positions % n if self.seed is None else shuffled_ids(positions, n, self.seed)

  def __call__(self, step) -> dict[str, np.ndarray]:
    return self.examples(self.example_ids(int(step)))

  def __repr__(self) -> str:
    # Stable across runs and processes (no addresses): Grain logs it, and
    # `grain.DataLoader` compares such reprs when restoring state.
    return (
        f"StepBatches({self.examples!r}, {self.schedule!r},"
        f" process={self.process_index}/{self.process_count}, seed={self.seed})"
    )


def _schedule(global_batch: int | BatchSchedule) -> BatchSchedule:
  if isinstance(global_batch, BatchSchedule):
    return global_batch
  return BatchSchedule.constant(global_batch)


def _process_rows(schedule: BatchSchedule, step: int, process_index: int,
                  process_count: int) -> np.ndarray:
  """Stream rows of this process's contiguous share of global step `step`."""
  local = schedule.size(step) // process_count
  start = schedule.first_row(step) + process_index * local
  return np.arange(start, start + local)


def shuffled_ids(positions: np.ndarray, num_examples: int, seed: int) -> np.ndarray:
  """Example id at each stream position of an endless order reshuffled every epoch
  (position g: `permute(g % n, n, seed, g // n)`): the train order of `StepBatches` and of
  each mixture component."""
  epoch, offset = np.divmod(np.asarray(positions, dtype=np.int64), num_examples)
  ids = np.empty_like(offset)
  for e in np.unique(epoch).tolist():
    here = epoch == e
    ids[here] = permute(offset[here], num_examples, seed, e)
  return ids


class MixtureBatches:
  """Global step s -> this process's batch of a mixture (`data.mixture`).

  `mixture.MixtureRows` says which component feeds each row and at which of
  its stream positions; each component orders its own stream as `StepBatches`
  does (seeded by the run's seed and the component's name). Pure like
  `StepBatches`: a restored iterator recomputes exactly the same batches.
  """

  def __init__(self, rows: mixture_lib.MixtureRows, examples: dict, *,
               global_batch: int | BatchSchedule, process_index: int, process_count: int,
               seed: int):
    self.rows, self.examples = rows, examples
    self.schedule = _schedule(global_batch)
    self.process_index, self.process_count = process_index, process_count
    self.seeds = {name: zlib.crc32(f"{seed}/{name}".encode()) for name in examples}

  @classmethod
  def build(cls, config: DataConfig, *, seed: int, process_index: int,
            process_count: int) -> MixtureBatches:
    """The components' train examples and the stages, in rows of this batch schedule."""
    examples = _per_component(config, lambda component: _examples(component, "train"))
    return cls(mixture_rows(config, seed), examples, global_batch=BatchSchedule.of(config),
               process_index=process_index, process_count=process_count, seed=seed)

  def __call__(self, step) -> dict[str, np.ndarray]:
    rows = _process_rows(self.schedule, int(step), self.process_index, self.process_count)
    component, position = self.rows.assign(rows)
    batch: dict[str, np.ndarray] = {}
    for index, (name, examples) in enumerate(self.examples.items()):
      here = component == index
      if not here.any():
        continue
      part = examples(shuffled_ids(position[here], examples.num_examples, self.seeds[name]))
      for key, value in part.items():
        if key not in batch:
          batch[key] = np.empty((len(rows), *value.shape[1:]), value.dtype)
        batch[key][here] = value
    return batch

  def __repr__(self) -> str:
    return (f"MixtureBatches({self.rows!r}, {list(self.examples.values())!r}, "
            f"{self.schedule!r}, process={self.process_index}/{self.process_count})")


def mixture_rows(config: DataConfig, seed: int) -> mixture_lib.MixtureRows:
  """The rows each component of `config.mixture` feeds: stages from steps to rows (through
  the batch schedule)."""
  schedule = BatchSchedule.of(config)
  stages = [(schedule.first_row(stage.step), config.mixture.weights(stage))
            for stage in config.mixture.stages]
  return mixture_lib.MixtureRows(list(config.mixture.components), stages, seed=seed)


def validation_sets(config: DataConfig, *, seed: int, process_index: int | None = None,
                    process_count: int | None = None) -> dict[str, grain.IterDataset]:
  """Each mixture component's validation split, by name (`build_dataset` of each)."""
  return _per_component(config, lambda component: build_dataset(
      component, split="validation", seed=seed, process_index=process_index,
      process_count=process_count))


def _per_component(config: DataConfig, build):
  """{name: build(the component's own config)} over a mixture's components; a DataError
  names the component it came from."""
  built = {}
  for name in config.mixture.components:
    try:
      built[name] = build(config.component(name))
    except DataError as e:
      raise DataError(f"data.mixture.components.{name}: {e}") from e
  return built


def _digits_examples(config: DataConfig, split: Split) -> examples_lib.DigitsExamples:
  images, labels = sources.load_digits()
  held_out = hash_uniform(np.arange(len(labels)), salt=0) < config.holdout_fraction
  keep = held_out if split == "validation" else ~held_out
  examples = examples_lib.DigitsExamples(images[keep], labels[keep], split)
  needed = config.batch_size if split == "validation" else 1  # train wraps around epochs
  if examples.num_examples < needed:
    raise DataError(
        f"data: the {split} split has {examples.num_examples} images and needs at least"
        f" {needed} (validation: one global batch, data.batch_size); change"
        f" data.validation_fraction (now {config.holdout_fraction}) or data.batch_size"
    )
  return examples


def _lm_too_small(config: DataConfig, split: Split, corpus: corpus_lib.TokenCorpus) -> DataError:
  """The error for a split with fewer tokens than one batch needs; names what to change."""
  fraction = config.holdout_fraction
  if split == "validation" and fraction == 0:
    return DataError(
        "data: the validation split is empty: data.validation_fraction=0.0 holds out"
        " nothing; set it above 0 (or, in a recipe, turn evaluation off: train.eval_every=0)"
    )
  seq_len, batch = config.seq_len, config.batch_size
  if split == "validation":
    need = (f"one global batch needs at least data.batch_size x data.seq_len + 1 ="
            f" {batch} x {seq_len} + 1 = {batch * seq_len + 1}")
    fix = f"raise data.validation_fraction (now {fraction}), lower data.batch_size or data.seq_len"
  else:
    need = f"one example needs at least data.seq_len + 1 = {seq_len + 1}"
    fix = f"lower data.seq_len or data.validation_fraction (now {fraction})"
  return DataError(
      f"data: the {split} split has {corpus.num_tokens} tokens; {need}: {fix}, or add"
      f" documents ({corpus.description})"
  )


def _lm_examples(config: DataConfig, split: Split):
  if config.is_chat:
    return _chat_examples(config, split)
  corpus = load_corpus(config)[split]
  needed = config.batch_size if split == "validation" else 1  # train wraps around epochs
  examples = None
  if corpus.num_tokens >= config.seq_len + 1:
    if config.packing:
      examples = examples_lib.LMPacked(corpus, config.seq_len, build_tokenizer(config).pad_id)
    else:
      examples = examples_lib.LMWindows(corpus, config.seq_len)
  if examples is None or examples.num_examples < needed:
    raise _lm_too_small(config, split, corpus)
  return examples


def _chat_examples(config: DataConfig, split: Split) -> chat.ChatRows | preference.PreferenceRows:
  load = preference.load_preferences if config.is_preference else chat.load_chat
  splits = load(config)
  rows = splits[split]
  if rows.num_examples < (config.batch_size if split == "validation" else 1):
    counted = "pairs" if config.is_preference else "conversations"
    what = "preference pairs" if config.is_preference else "conversations"
    dropped = ""
    if rows.stats["dropped"]:
      dropped = (f"; {rows.stats['dropped']} {what} were dropped, their assistant turn "
                 f"beyond data.seq_len + 1 = {config.seq_len + 1} tokens: raise data.seq_len")
    unit = "rows of preference pairs" if config.is_preference else "packed rows of conversations"
    raise too_few(config, split, have=rows.num_examples, unit=unit, what=what,
                  kept={name: r.stats[counted] for name, r in splits.items()},
                  per_row=splits["train"].stats[counted] / max(splits["train"].num_examples, 1),
                  dropped=dropped)
  return rows


def _prompt_examples(config: DataConfig, split: Split) -> prompts.PromptRows:
  splits = prompts.load_prompts(config)
  rows = splits[split]
  if rows.num_examples < (config.batch_size if split == "validation" else 1):
    raise too_few(config, split, have=rows.num_examples, unit="prompts", what="prompts",
                  kept={name: r.num_examples for name, r in splits.items()}, per_row=1.0)
  return rows


def too_few(config: DataConfig, split: Split, *, have: int, unit: str, what: str,
            kept: dict[str, int], per_row: float, dropped: str = "") -> DataError:
  """The error (or, as a run turns evaluation off, the note) for a chat, preference or prompt
  split with less than a batch (validation) or nothing (train): one wording for all three,
  each field named with its value, and how many `what` a held-out batch takes.

  `kept`: each split's count of `what`; `per_row`: how many a row holds (packed
  conversations: several). The fraction it suggests is a hash split's: two standard
  deviations of the held-out count, and two more, above a batch's worth.

  Example:
    >>> from jax_ai_stack.recipes.data.config import DataConfig
    >>> config = DataConfig(source="chat", paths=("c.jsonl",), batch_size=8,
    ...                     validation_fraction=0.05)
    >>> print(too_few(config, "validation", have=1, unit="packed rows of conversations",
    ...               what="conversations", kept={"train": 28, "validation": 2}, per_row=1.5))
    data: the validation split has 1 packed rows of conversations and needs 8 (data.batch_size=8): it holds 2 of the 30 conversations (data.validation_fraction=0.05) and a batch takes about 12; lower data.batch_size, or add conversations (about 420 in all hold out a batch at data.validation_fraction=0.05)
  """
  fraction, batch = config.holdout_fraction, config.batch_size
  total = sum(kept.values())
  if split != "validation":
    return DataError(f"data: the {split} split has {have} {unit} and needs 1: lower "
                     f"data.validation_fraction (now {fraction}, holding out "
                     f"{kept.get('validation', 0)} of the {total} {what}){dropped}, or add {what}")
  needed = batch * per_row  # What a batch of rows takes.
  wanted = (needed + 2 * math.sqrt(needed) + 2) / max(total, 1)
  fix = "" if wanted > 0.5 else (
      f"set data.validation_fraction={math.ceil(wanted * 100) / 100:g} to hold out about a "
      "batch, ")
  more = (f" (about {math.ceil(wanted * total / fraction / 10) * 10} in all hold out a batch at "
          f"data.validation_fraction={fraction})") if fraction > 0 else ""
  return DataError(
      f"data: the {split} split has {have} {unit} and needs {batch} (data.batch_size={batch}): "
      f"it holds {kept.get('validation', 0)} of the {total} {what} (data.validation_fraction="
      f"{fraction}) and a batch takes about {math.ceil(needed)}; {fix}lower data.batch_size"
      f"{dropped}, or add {what}{more}")


def _examples(config: DataConfig, split: Split):
  """Examples of `split`, with at least one batch of them (validation) or one (train)."""
  if config.is_token_source:
    return _lm_examples(config, split)
  if config.source == "digits":
    return _digits_examples(config, split)
  if config.is_prompts:
    return _prompt_examples(config, split)
  raise ConfigError(f"data.source={config.source!r} has no data here: the batches come from "
                    "your Task's `dataset` (tasks.CustomTask, or a Task subclass)")


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
    DataError: bad or too little data; the message names the file or the
      fields to change (a missing file is also a FileNotFoundError).
    ConfigError: fields that do not fit together (batch_size and process_count).
    MissingExtraError: an optional package the source or tokenizer needs.
    ValueError: `split` or `process_index` out of range (a bug of the caller).
  """
  if split not in ("train", "validation"):
    raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
  process_index, process_count = _process(process_index, process_count)
  for field, size in config.batch_sizes():
    if size % process_count:
      raise ConfigError(f"{field}={size} is not divisible by the process_count={process_count}")
  if config.mixture is not None:
    if split == "validation":
      raise ValueError("a mixture's validation splits are its components': build each with "
                       "build_dataset(config.component(name), ...) (validation_sets does)")
    batches = MixtureBatches.build(config, seed=seed, process_index=process_index,
                                   process_count=process_count)
    num_steps = sys.maxsize
  else:
    examples = _examples(config, split)
    num_steps = sys.maxsize if split == "train" else examples.num_examples // config.batch_size
    batches = StepBatches(
        examples,
        global_batch=BatchSchedule.of(config) if split == "train" else config.batch_size,
        process_index=process_index,
        process_count=process_count,
        seed=seed if split == "train" else None,
    )
  ds = grain.MapDataset.range(num_steps).map(batches)
  # Batches are built whole in one call: Grain's per-element thread pool would
  # only add overhead, so read synchronously and prefetch one batch stream.
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  if config.num_workers:
    grain_flags_readable()  # mp_prefetch reads an absl flag (see absl_flags).
    options = grain.experimental.DatasetOptions(min_shm_size=_MIN_SHARED_MEMORY_BYTES)
    ds = grain.experimental.WithOptionsIterDataset(ds, options)
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=config.num_workers,
        per_worker_buffer_size=max(config.prefetch_batches, 1),
    ))
  elif config.prefetch_batches:
    ds = grain.experimental.ThreadPrefetchIterDataset(
        ds, prefetch_buffer_size=config.prefetch_batches)
  return ClosedAtExit(ds)
