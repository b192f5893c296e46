"""Shared by the trainer and CLI tests: the tiny LM recipe and a training subprocess."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

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


def kill_at_step(preset: str, workdir: pathlib.Path, overrides: list[str], step: int) -> int:
  """`jax-ai-stack train preset` in a subprocess, SIGKILLed once it has logged `step`;
  returns the last step it logged."""
  process = subprocess.Popen(
      [sys.executable, "-m", "jax_ai_stack.cli", "train", preset, "--workdir", str(workdir),
       *overrides], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  wait_for_step(process, workdir, step)
  process.send_signal(signal.SIGKILL)
  process.wait()
  return train_losses(workdir)[-1][0]
