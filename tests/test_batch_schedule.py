"""Batch sizes that change at named steps: the stream is read in order whatever the sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import config as config_lib
from jax_ai_stack.recipes import train
from jax_ai_stack.recipes.data import BatchSchedule, DataConfig, build_dataset
from data_helpers import read_batches
from multidevice import run_on_devices
from training_helpers import TINY, train_losses


def test_first_rows_add_up_the_sizes_before():
  schedule = BatchSchedule([0, 3, 7, 8], [4, 8, 2, 16])
  sizes = [schedule.size(s) for s in range(12)]
  assert sizes == [4, 4, 4, 8, 8, 8, 8, 2, 16, 16, 16, 16]
  assert [schedule.first_row(s) for s in range(12)] == np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()


@pytest.mark.parametrize("starts,sizes", [([1], [4]), ([0, 5, 5], [4, 8, 2]), ([0], [0]),
                                          ([0, 2], [4])])
def test_a_schedule_starts_at_0_goes_forward_and_has_a_size_per_step(starts, sizes):
  with pytest.raises(ValueError):
    BatchSchedule(starts, sizes)


@pytest.mark.parametrize("schedule,message", [
    ("[{step: 0, batch_size: 8}]", r"data.batch_schedule\[0\].step=0 goes back in time: it must "
                                   r"come after step 0 \(data.batch_size is the batch until"),
    ("[{step: 5, batch_size: 8}, {step: 5, batch_size: 4}]",
     r"data.batch_schedule\[1\].step=5 goes back in time: it must come after the entry before"),
    ("[{step: 5, batch_size: 0}]", r"data.batch_schedule\[0\].batch_size must be >= 1, got 0"),
])
def test_a_bad_schedule_is_refused_naming_the_entry(schedule, message):
  with pytest.raises(ConfigError, match=message):
    config_lib.load("lm-tiny", overrides=[f"data.batch_schedule={schedule}"])


def test_a_microbatch_must_split_every_batch():
  with pytest.raises(ConfigError, match=r"data.batch_schedule\[0\].batch_size=12 does not split "
                                        r"into micro-batches of train.microbatch_size=8 rows"):
    config_lib.load("lm-tiny", overrides=["data.batch_schedule=[{step: 5, batch_size: 12}]",
                                          "train.microbatch_size=8"])


@pytest.fixture
def tokens(tmp_path):
  path = tmp_path / "tokens.npy"
  np.save(path, np.arange(5000, dtype=np.int32) % 251)
  return str(path)


def _data(tokens, schedule=(), batch_size=4):
  return DataConfig(source="npy", paths=(tokens,), seq_len=8, batch_size=batch_size,
                    validation_fraction=0.3, split_chunk_tokens=64, prefetch_batches=0,
                    batch_schedule=tuple(dict(step=s, batch_size=n) for s, n in schedule))


def test_the_stream_is_read_in_order_whatever_the_sizes(tokens):
  scheduled = read_batches(_data(tokens, [(3, 8), (5, 2)]), 8)
  assert [len(b["inputs"]) for b in scheduled] == [4, 4, 4, 8, 8, 2, 2, 2]
  rows = np.concatenate([b["inputs"] for b in scheduled])
  constant = np.concatenate([b["inputs"] for b in read_batches(_data(tokens, batch_size=2), 17)])
  np.testing.assert_array_equal(rows, constant)  # The same rows, in the same order.


def test_processes_split_each_scheduled_batch(tokens):
  data = _data(tokens, [(2, 8)])
  whole = read_batches(data, 4)
  halves = [read_batches(data, 4, process_index=p, process_count=2) for p in (0, 1)]
  for step, batch in enumerate(whole):
    np.testing.assert_array_equal(
        batch["inputs"], np.concatenate([halves[0][step]["inputs"], halves[1][step]["inputs"]]))


def test_a_size_that_does_not_divide_by_the_processes_is_refused(tokens):
  with pytest.raises(ConfigError, match=r"data.batch_schedule\[0\].batch_size=6 is not divisible "
                                        r"by the process_count=4"):
    build_dataset(_data(tokens, [(2, 6)]), split="train", seed=0, process_index=0,
                  process_count=4)


def test_validation_keeps_data_batch_size(tokens):
  batches = read_batches(_data(tokens, [(1, 8)]), 3, split="validation")
  assert {len(b["inputs"]) for b in batches} == {4}


def test_a_mixture_stage_starts_at_its_step_after_a_size_change(tmp_path):
  for name, value in (("ay", 1), ("bee", 2)):
    np.save(tmp_path / f"{name}.npy", np.full(4000, value, np.int32))
  mixture = {"components": {n: {"source": "npy", "paths": [str(tmp_path / f"{n}.npy")]}
                            for n in ("ay", "bee")},
             "stages": [{"step": 0, "weights": {"ay": 1}}, {"step": 3, "weights": {"bee": 1}}]}
  data = config_lib.load("lm-tiny", overrides=[
      *TINY, "data.max_documents=null", f"data.mixture={json.dumps(mixture)}",
      "data.batch_schedule=[{step: 2, batch_size: 8}]", "data.prefetch_batches=0"]).data
  batches = read_batches(data, 5)
  assert [sorted(set(b["inputs"].ravel().tolist())) for b in batches] == [[1]] * 3 + [[2]] * 2
  assert [len(b["inputs"]) for b in batches] == [4, 4, 8, 8, 8]


@pytest.mark.slow
def test_a_grown_batch_trains_and_reports_its_throughput(tmp_path):
  config = config_lib.load("lm-tiny", overrides=[
      *TINY, "train.steps=6", "train.log_every=1", "train.sample_tokens=0", "train.eval_every=0",
      "data.batch_schedule=[{step: 3, batch_size: 8}]", "train.microbatch_size=4"])
  train.run(config, tmp_path)
  records = [r for r in train.read_metrics(tmp_path) if r["split"] == "train"]
  assert len(records) == 6 and all(np.isfinite(r["loss"]) for r in records)
  tokens_per_step = [r["throughput"] * r["step_time"] for r in records]
  np.testing.assert_allclose(tokens_per_step, [4 * 16] * 3 + [8 * 16] * 3, rtol=1e-6)


def _cli(*args, devices):
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
  return subprocess.run([sys.executable, "-m", "jax_ai_stack.cli", "train", "lm-tiny", *TINY,
                         *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("args,message", [
    (["data.batch_schedule=[{step: 5, batch_size: 6}]"],
     "data.batch_schedule[0].batch_size=6: the batch has shape (6,): dimension 0 ('batch', size 6) "
     "does not divide by mesh axes data x fsdp x expert of size 4"),
    (["data.batch_schedule=[{step: 5, batch_size: 8}]", "train.microbatch_size=2"],
     "train.microbatch_size=2: the batch has shape (2,)"),
])
def test_a_size_the_mesh_cannot_split_is_refused_before_anything_is_written(tmp_path, args,
                                                                             message):
  result = _cli("--workdir", str(tmp_path / "w"), *args, devices=4)
  assert result.returncode == 2, result.stderr
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and message in lines[0], result.stderr
  assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_a_grown_batch_in_micro_batches_on_a_mesh_trains_as_on_one_device(tmp_path):
  overrides = [*TINY, "train.steps=4", "train.sample_tokens=0", "train.eval_every=0",
               "data.batch_schedule=[{step: 2, batch_size: 16}]", "train.microbatch_size=8"]
  train.run(config_lib.load("lm-tiny", overrides=overrides), tmp_path / "one")
  on_mesh = run_on_devices("lm_tiny_losses_on_mesh", tmp_path / "mesh",
                           [*overrides, "mesh.fsdp=2"], devices=4)
  one = train_losses(tmp_path / "one")
  assert [step for step, _ in on_mesh] == [step for step, _ in one] == [1, 2, 3, 4]
  np.testing.assert_allclose([loss for _, loss in on_mesh], [loss for _, loss in one], rtol=1e-5)


def test_a_task_s_own_batches_take_no_schedule():
  with pytest.raises(ConfigError, match=r"data.batch_schedule: with data.source='custom' the "
                                        r"batches come from your Task's `dataset`"):
    config_lib.load("none", overrides=["model.kind=custom", "data.source=custom",
                                       "data.batch_schedule=[{step: 5, batch_size: 8}]"])
