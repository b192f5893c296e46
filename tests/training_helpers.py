"""Shared by the trainer and CLI tests: the tiny LM recipe, a training subprocess, and what
tells two runs apart (their logged records, their final state's arrays)."""

from __future__ import annotations

import hashlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jax_ai_stack.recipes import checkpoint, config, train
from jax_ai_stack.recipes.checkpoint import io as checkpoint_io

TINY = [
    "model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
    "model.mlp_dim=64", "model.max_seq_len=32", "data.seq_len=16", "data.batch_size=4",
    "data.max_documents=30", "data.validation_fraction=0.2", "train.eval_every=10",
    "train.eval_batches=2", "train.sample_tokens=8", "train.progress=false",
    "checkpoint.save_every=5", "optim.warmup_steps=2",
]
STEPS = 30


def tiny_config(*extra: str) -> config.RecipeConfig:
  return config.load("lm-tiny", overrides=[*TINY, f"train.steps={STEPS}", *extra])


def train_losses(workdir) -> list[tuple[int, float]]:
  return [(r["step"], r["loss"]) for r in train.read_metrics(workdir) if r["split"] == "train"]


def start_training(workdir: pathlib.Path, *extra: str) -> subprocess.Popen:
  command = [sys.executable, "-m", "jax_ai_stack.cli", "train", "lm-tiny", "--workdir",
             str(workdir), *TINY, f"train.steps={STEPS}", *extra]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_for_step(process: subprocess.Popen, workdir: pathlib.Path, step: int) -> None:
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline:
    losses = train_losses(workdir)  # Read once: a resume may cut the file back in between.
    if losses and losses[-1][0] >= step:
      return
    if process.poll() is not None:
      pytest.fail(f"training ended early: {process.stdout.read()}")
    time.sleep(0.02)
  process.kill()
  pytest.fail("training did not reach the step in time")


def checkpoint_paths(workdir: pathlib.Path) -> list[str]:
  """The array paths of the newest checkpoint's state in `workdir`."""
  manager = checkpoint.build_manager(workdir / train.CHECKPOINT_DIR,
                                     checkpoint.CheckpointConfig(), read_only=True)
  try:
    return list(checkpoint_io._shapes_by_path(manager.item_metadata(manager.latest_step())["state"]))
  finally:
    manager.close()


def kill_at_step(preset: str, workdir: pathlib.Path, overrides: list[str], step: int, *,
                 devices: int = 1) -> int:
  """`jax-ai-stack train preset` in a subprocess on `devices` CPU devices, SIGKILLed once
  it has logged `step`; returns the last step it logged."""
  # No persistent compilation cache: jax 0.10 writes an entry in place (lru_cache.py's
  # write_bytes), so a process killed mid-write leaves a truncated entry that a later reader
  # of the shared test cache crashes on (a segfault in get_executable_and_time).
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices),
             JAX_ENABLE_COMPILATION_CACHE="false")
  process = subprocess.Popen(
      [sys.executable, "-m", "jax_ai_stack.cli", "train", preset, "--workdir", str(workdir),
       *overrides], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
  wait_for_step(process, workdir, step)
  process.send_signal(signal.SIGKILL)
  process.wait()
  return train_losses(workdir)[-1][0]


def records(workdir, split: str) -> list[dict]:
  """The run's logged records of `split`, less the wall-clock fields that no two runs share."""
  clock = {"step_time", "throughput"}
  return [{k: v for k, v in r.items() if k not in clock}
          for r in train.read_metrics(workdir) if r["split"] == split]


def state_digests(workdir) -> dict[str, str]:
  """Each array of the finished run's state (parameters, optimizer moments, RNG, step) by
  path, as its dtype, shape and a hash of its bytes: two runs are bitwise the same when
  these are equal, and a difference names the array."""
  trainer = train.Trainer.open_finished(workdir, optimizer_state=True)
  trainer.close()
  digests = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(trainer.state)[0]:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    array = np.asarray(leaf)
    digest = hashlib.sha256(array.tobytes()).hexdigest()[:16]
    digests[jax.tree_util.keystr(path)] = f"{array.dtype}{list(array.shape)} {digest}"
  return digests


def finish_both(preset: str, overrides: list[str], whole: pathlib.Path,
                killed: pathlib.Path) -> dict[str, dict[str, str]]:
  """Trains `whole` through without a stop and resumes the killed run in `killed` with the
  same settings; returns each one's `state_digests`."""
  settings = config.load(preset, overrides=overrides)
  train.run(settings, whole)
  train.run(settings, killed)
  return {"whole": state_digests(whole), "killed": state_digests(killed)}
