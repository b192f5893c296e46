"""Runs the programs of tests/programs/ in fresh interpreters, some on N simulated CPU devices.

The rest of the suite keeps its one device: JAX fixes the device count when it
starts, so a test that needs a mesh runs a program with `JAX_NUM_CPU_DEVICES` set
(`run_on_devices`) and reads back what the program prints as JSON. Other tests need
a fresh interpreter for what a process does once (exit hooks, signals, its imports,
its command line): `run_program`. A program is a plain file, tests/programs/<name>.py,
that reads its inputs from `sys.argv`, so linters see it like any other module.

The programs that compare a Hugging Face reference checkpoint on a mesh with one
device share the rest of this module (they put tests/ on `sys.path`, then import it).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import optax
from flax import nnx

PROGRAMS = pathlib.Path(__file__).resolve().with_name("programs")
"""tests/programs/: one file per program, named by what it does."""


def run_program(program: str, *args, env: dict[str, str] | None = None, timeout: float = 600,
                **options) -> subprocess.CompletedProcess:
  """Runs tests/programs/`program`.py in a fresh interpreter with `args` on its command line
  (a str or path as itself, anything else as its JSON), in `env` (None: this process's);
  `options` go to `subprocess.run` (by default, stdout and stderr captured as text)."""
  options = {"capture_output": True, "text": True, **options}
  command = [sys.executable, str(PROGRAMS / f"{program}.py"),
             *(os.fspath(a) if isinstance(a, (str, os.PathLike)) else json.dumps(a) for a in args)]
  return subprocess.run(command, env=env, timeout=timeout, **options)


def run_on_devices(program: str, *args, devices: int = 8, timeout: int = 600,
                   with_stderr: bool = False) -> object:
  """Runs tests/programs/`program`.py with `args` (as `run_program`) on `devices` CPU
  devices; returns the JSON its last line prints (and, `with_stderr`, what it wrote to
  stderr: XLA's C++ warnings go there, past Python; the persistent compilation cache is
  then off, since a program read from it is not compiled and warns of nothing)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
  if with_stderr:
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  result = run_program(program, *args, env=env, timeout=timeout)
  if result.returncode != 0:
    raise AssertionError(f"the program {program} failed on {devices} devices:\n"
                         f"{result.stdout}\n{result.stderr}")
  printed = json.loads(result.stdout.strip().splitlines()[-1])
  return (printed, result.stderr) if with_stderr else printed


def next_token_loss(model: nnx.Module, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(mean next-token cross-entropy, logits) of `tokens` [B, T]."""
  logits = model(tokens)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], tokens[:, 1:]).mean(), logits


@nnx.jit
def logits_and_grads(model: nnx.Module, tokens: jax.Array):
  """The logits of `tokens` and the gradient of `next_token_loss`."""
  (_, logits), grads = nnx.value_and_grad(next_token_loss, has_aux=True)(model, tokens)
  return logits, grads


def grads_difference(grads, expected) -> float:
  """The largest difference of two gradients, leaf by leaf relative to `expected`'s max."""
  return max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / (np.abs(b).max() + 1e-12))
             for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)))


def load_on_mesh(directory: str, mesh_config, attention=None):
  """The Hugging Face checkpoint in `directory` read straight onto the mesh of
  `mesh_config` (a `MeshConfig`), each tensor placed by its rule set, as a fine-tuning
  run's import does; the model holds the mesh's layout (and `attention`, a plan)."""
  from jax_ai_stack.recipes import sharding
  from jax_ai_stack.recipes.models import hf
  from jax_ai_stack.recipes.models.configs import DecoderConfig
  from jax_ai_stack.recipes.models.decoder import Decoder

  config = DecoderConfig(**hf.read_config(directory))
  mesh, rules = sharding.build_mesh(mesh_config), sharding.logical_rules(mesh_config)
  model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0), attention=attention,
                                       layout=sharding.Layout.of(mesh, rules)))
  params = nnx.state(model)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          params, sharding.state_shardings(params, mesh, rules))
  nnx.update(model, hf.load_params(directory, config, abstract))
  return model
