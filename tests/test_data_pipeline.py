"""build_dataset: batch contract, determinism, sharding, validation, state, workers."""

from __future__ import annotations

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
from absl import flags

from jax_ai_stack.errors import ConfigError, DataError
from data_helpers import assert_same_batches as _assert_same
from data_helpers import read_batches as _batches
from jax_ai_stack.recipes.data import (
    DataConfig,
    LMWindows,
    StepBatches,
    build_dataset,
    epoch_permutation,
    load_corpus,
)

LM = DataConfig(max_documents=40, seq_len=16, batch_size=4)




class _Ids:
  """Examples that are their own ids, to watch the order."""

  def __init__(self, num_examples):
    self.num_examples = num_examples

  def __call__(self, ids):
    return {"ids": ids}


@pytest.mark.parametrize("packing", [False, True])
def test_lm_batches_follow_the_contract(packing):
  config = DataConfig(max_documents=40, seq_len=16, batch_size=4, packing=packing)
  batch = _batches(config, 1)[0]
  assert set(batch) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
  for key, value in batch.items():
    assert value.shape == (4, 16), key
    assert value.dtype == (np.float32 if key == "loss_mask" else np.int32), key
  same_segment = batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1]
  # Within a segment the next input is the previous target.
  assert np.all((batch["inputs"][:, 1:] == batch["targets"][:, :-1])[same_segment])
  if packing:
    np.testing.assert_array_equal(batch["loss_mask"], batch["segment_ids"] > 0)
    starts = ~np.concatenate([np.zeros((4, 1), bool), same_segment], axis=1)
    assert np.all(batch["positions"][starts] == 0)
  else:
    np.testing.assert_array_equal(batch["segment_ids"], 1)


def test_same_seed_same_batches_another_seed_differs():
  first, again = _batches(LM, 5, seed=7), _batches(LM, 5, seed=7)
  _assert_same(first, again)
  other = _batches(LM, 5, seed=8)
  assert not all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, other))


def test_each_epoch_visits_every_example_once_and_is_reshuffled():
  batches = StepBatches(_Ids(12), global_batch=4, process_index=0, process_count=1, seed=3)
  epochs = [np.concatenate([batches(step)["ids"] for step in range(e * 3, e * 3 + 3)])
            for e in range(3)]
  for order in epochs:
    np.testing.assert_array_equal(np.sort(order), np.arange(12))
  assert len({tuple(order) for order in epochs}) == 3
  assert not np.array_equal(epochs[0], np.arange(12))


def test_batches_may_straddle_epochs():
  batches = StepBatches(_Ids(5), global_batch=4, process_index=0, process_count=1, seed=0)
  stream = np.concatenate([batches(step)["ids"] for step in range(5)])  # 20 = 4 epochs
  for epoch in range(4):
    np.testing.assert_array_equal(stream[epoch * 5:epoch * 5 + 5],
                                  epoch_permutation(5, 0, epoch))


def test_order_is_a_pure_function_of_the_step():
  ds = build_dataset(LM, split="train", seed=1, process_index=0, process_count=1)
  iterator = iter(ds)
  for _ in range(6):
    next(iterator)
  sixth = next(iterator)
  fresh = iter(ds)
  fresh.set_state({"next_index": 6})  # jump straight to step 6
  _assert_same([next(fresh)], [sixth])
  iterator.close()
  fresh.close()


def test_two_processes_read_disjoint_halves_of_the_global_batch():
  config = DataConfig(max_documents=40, seq_len=16, batch_size=8)
  global_batches = _batches(config, 3)
  halves = [_batches(config, 3, process_index=p, process_count=2) for p in range(2)]
  for step, whole in enumerate(global_batches):
    joined = {k: np.concatenate([halves[0][step][k], halves[1][step][k]]) for k in whole}
    _assert_same([joined], [whole])
    assert halves[0][step]["inputs"].shape == (4, 16)
  # Disjoint examples: no window of process 0 appears in process 1 at that step.
  examples = StepBatches(_Ids(10**6), global_batch=8, process_index=0, process_count=2, seed=0)
  other = StepBatches(_Ids(10**6), global_batch=8, process_index=1, process_count=2, seed=0)
  for step in range(3):
    assert not set(examples(step)["ids"]) & set(other(step)["ids"])


def test_global_batch_must_divide_among_processes():
  with pytest.raises(ConfigError, match=r"batch_size=4 is not divisible by the process_count=3"):
    build_dataset(LM, split="train", seed=0, process_index=0, process_count=3)


def test_process_defaults_come_from_jax():
  _assert_same(_batches(LM, 2), _batches(LM, 2, process_index=None, process_count=None))


def _text_config(tmp_path, **fields) -> DataConfig:
  for i in range(40):
    (tmp_path / f"d{i:02d}.txt").write_text(f"text number {i} " * 5)
  fields = {"source": "text", "paths": (str(tmp_path / "*.txt"),), "seq_len": 8,
            "batch_size": 4, "validation_fraction": 0.3, **fields}
  return DataConfig(**fields)


def test_validation_is_one_pass_in_order_with_the_remainder_dropped(tmp_path):
  config = _text_config(tmp_path)
  corpus = load_corpus(config)["validation"]
  windows = (corpus.num_tokens - 1) // 8
  batches = list(build_dataset(config, split="validation", seed=0, process_index=0,
                               process_count=1))
  assert len(batches) == windows // 4
  inputs = np.concatenate([b["inputs"] for b in batches])
  expected = corpus.tokens[:len(inputs) * 8].reshape(-1, 8)
  np.testing.assert_array_equal(inputs, expected)  # corpus order, no shuffle
  halves = [list(build_dataset(config, split="validation", seed=5, process_index=p,
                               process_count=2)) for p in range(2)]
  assert len(halves[0]) == len(halves[1]) == len(batches)
  np.testing.assert_array_equal(halves[1][0]["inputs"], batches[0]["inputs"][2:])


@pytest.mark.parametrize("packing", [False, True])
def test_too_little_validation_data_says_how_many_tokens(tmp_path, packing):
  config = _text_config(tmp_path, batch_size=4096, packing=packing)
  tokens = load_corpus(config)["validation"].num_tokens
  message = (rf"data: the validation split has {tokens} tokens; one global batch needs at least"
             r" data\.batch_size x data\.seq_len \+ 1 = 4096 x 8 \+ 1 = 32769: raise"
             r" data\.validation_fraction \(now 0\.3\), lower data\.batch_size or data\.seq_len")
  with pytest.raises(DataError, match=message):
    build_dataset(config, split="validation", seed=0, process_index=0, process_count=1)


def test_no_validation_fraction_no_validation_split(tmp_path):
  with pytest.raises(DataError, match=r"validation split is empty.*validation_fraction=0.0"):
    build_dataset(_text_config(tmp_path, validation_fraction=0.0), split="validation",
                  seed=0, process_index=0, process_count=1)


def test_seq_len_longer_than_the_split_is_an_error(tmp_path):
  config = _text_config(tmp_path, seq_len=100000)
  tokens = load_corpus(config)["train"].num_tokens
  message = (rf"the train split has {tokens} tokens; one example needs at least"
             r" data\.seq_len \+ 1 = 100001: lower data\.seq_len")
  with pytest.raises(DataError, match=message):
    build_dataset(config, split="train", seed=0, process_index=0, process_count=1)


def test_iterator_state_round_trip_without_workers():
  ds = build_dataset(LM, split="train", seed=2, process_index=0, process_count=1)
  iterator = iter(ds)
  for _ in range(3):
    next(iterator)
  state = iterator.get_state()
  expected = [next(iterator) for _ in range(4)]
  restored = iter(ds)
  restored.set_state(state)
  _assert_same([next(restored) for _ in range(4)], expected)


def _orbax_round_trip(config, directory):
  """Saves after 3 batches in an Orbax manager, restores into a fresh iterator."""
  reference = _batches(DataConfig(**{**config.__dict__, "num_workers": 0}), 7)
  ds = build_dataset(config, split="train", seed=0, process_index=0, process_count=1)
  iterator = iter(ds)
  with ocp.CheckpointManager(directory) as manager:
    seen = [next(iterator) for _ in range(3)]
    manager.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)))
    manager.wait_until_finished()
    seen += [next(iterator) for _ in range(4)]
    iterator.close()
    _assert_same(seen, reference)  # workers change nothing in the output
    restored = iter(ds)
    manager.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored)))
    _assert_same([next(restored) for _ in range(4)], reference[3:])
    restored.close()


def test_orbax_checkpoint_round_trip_without_workers(tmp_path):
  _orbax_round_trip(LM, tmp_path / "ckpt")


def test_orbax_checkpoint_round_trip_with_two_workers(tmp_path):
  # Outside absl.app.run the flags are unparsed; Grain's workers used to fail
  # with UnparsedFlagAccessError there. build_dataset handles it.
  was_parsed = flags.FLAGS.is_parsed()
  flags.FLAGS.unparse_flags()
  try:
    _orbax_round_trip(DataConfig(max_documents=40, seq_len=16, batch_size=4, num_workers=2),
                      tmp_path / "ckpt")
  finally:  # Later tests in this process find the flags as they were (tokamax 0.0.12 reads
    if was_parsed:  # pytest's argv when they are not).
      flags.FLAGS.mark_as_parsed()


def test_digits_batches_and_split():
  pytest.importorskip("sklearn")
  config = DataConfig(source="digits", batch_size=16)
  batch = _batches(config, 1)[0]
  assert set(batch) == {"images", "labels"}
  assert batch["images"].shape == (16, 8, 8, 1) and batch["images"].dtype == np.float32
  assert batch["labels"].shape == (16,) and batch["labels"].dtype == np.int32
  assert 0 <= batch["images"].min() and batch["images"].max() <= 1
  _assert_same(_batches(config, 3, seed=4), _batches(config, 3, seed=4))
  validation = list(build_dataset(config, split="validation", seed=0, process_index=0,
                                  process_count=1))
  held_out = len(validation) * 16
  assert 0.15 * 1797 < held_out <= 0.25 * 1797  # about 20%, remainder dropped
  # Train and validation share no image (the few duplicate digits aside).
  train_images = {b.tobytes() for b in np.concatenate(
      [b["images"] for b in _batches(config, 200)])}
  validation_images = {b.tobytes() for b in np.concatenate([b["images"] for b in validation])}
  assert len(train_images & validation_images) <= 5


def test_batch_function_repr_is_stable():
  # Grain logs it, and grain.DataLoader compares reprs of sources on restore:
  # no memory address may leak into it.
  def make():
    windows = LMWindows(load_corpus(LM)["train"], LM.seq_len)
    return StepBatches(windows, global_batch=4, process_index=0, process_count=1, seed=3)

  assert repr(make()) == repr(make())
  assert "0x" not in repr(make()) and "seq_len=16" in repr(make())
