"""The persistent compilation cache of the command line: where it goes, that a
second run loads its programs from it with the same bits, and that 'off' is off."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import compile_cache, phases, train

from training_helpers import TINY

HOME = pathlib.Path.home()


@pytest.mark.parametrize("setting, environ, expected", [
    ("off", {"JAX_COMPILATION_CACHE_DIR": "/j"}, None),
    ("", {}, None),
    (" OFF ", {}, None),
    ("auto", {"JAX_COMPILATION_CACHE_DIR": "/j", "XDG_CACHE_HOME": "/x"}, "/j"),
    ("auto", {"XDG_CACHE_HOME": "/x"}, "/x/jax-ai-stack/xla"),
    ("auto", {}, str(HOME / ".cache" / "jax-ai-stack" / "xla")),
    ("~/mine", {"JAX_COMPILATION_CACHE_DIR": "/j"}, str(HOME / "mine")),
    ("auto", {"JAX_ENABLE_COMPILATION_CACHE": "false", "XDG_CACHE_HOME": "/x"}, None),
])
def test_resolve_dir(setting, environ, expected):
  result = compile_cache.resolve_dir(setting, environ)
  assert (None if result is None else str(result)) == expected


def test_a_directory_that_cannot_be_created_is_a_config_error(tmp_path):
  blocker = tmp_path / "a-file"
  blocker.write_text("x")
  with pytest.raises(ConfigError, match=r"train.compile_cache: cannot create .*a-file/xla"):
    compile_cache.enable(str(blocker / "xla"), environ={})
  assert blocker.read_text() == "x"


@pytest.fixture
def restore_jax_cache_settings():
  """Puts back the suite's own cache settings (conftest.py) after a test changes them."""
  names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
           "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  before = {name: getattr(jax.config, name) for name in names}
  yield
  for name, value in before.items():
    jax.config.update(name, value)
  from jax.experimental.compilation_cache import compilation_cache as cc

  cc.reset_cache()


def test_enable_switches_the_cache_in_process_and_off_turns_it_off(
    tmp_path, restore_jax_cache_settings):
  jax_dir, mine = tmp_path / "from-jax-variable", tmp_path / "mine"
  assert compile_cache.enable(str(mine), environ={}) == mine
  assert compile_cache.active_dir() == str(mine)
  with compile_cache.CompileTimes() as times:
    jax.jit(lambda x: x * 11 + 1)(np.ones(5, np.float32)).block_until_ready()
  assert compile_cache.count_entries(mine) == 1 and times.cache_misses == 1  # Just the jit.

  environ = {"JAX_COMPILATION_CACHE_DIR": str(jax_dir)}
  assert compile_cache.enable("off", environ=environ) is None
  assert compile_cache.active_dir() is None
  with compile_cache.CompileTimes() as times:
    jax.jit(lambda x: x * 13 + 1)(np.ones(5, np.float32)).block_until_ready()
  assert times.compiles == 1 and times.cache_misses == times.cache_hits == 0
  assert not jax_dir.exists() and compile_cache.count_entries(mine) == 1

  assert compile_cache.enable("auto", environ=environ) == jax_dir
  jax.jit(lambda x: x * 17 + 1)(np.ones(5, np.float32)).block_until_ready()
  assert compile_cache.count_entries(jax_dir) == 1


def test_compile_times_counts_what_jax_reports_and_stops_listening():
  with compile_cache.CompileTimes() as times:
    jax.jit(lambda x: jnp.sin(x) * 7)(jnp.ones(3)).block_until_ready()
  assert times.compiles >= 1 and times.compile_s > 0 and times.trace_s > 0
  seen = times.compiles
  jax.jit(lambda x: jnp.cos(x) * 5)(jnp.ones(3)).block_until_ready()
  assert times.compiles == seen  # No longer listening.
  times.stop()  # A second stop is harmless.


def _clean_env(**extra: str) -> dict[str, str]:
  """The caller's environment without the test suite's own cache settings."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE",
                              "JAX_ENABLE_COMPILATION_CACHE"))}
  return {**env, "JAX_PLATFORMS": "cpu", **extra}


def _train(workdir: pathlib.Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
  command = [sys.executable, "-m", "jax_ai_stack.cli", "train", "lm-tiny", "--workdir",
             str(workdir), *TINY, "train.steps=3", "train.eval_every=0", "train.sample_tokens=0",
             "--verbose", *extra]
  return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def _startup(result: subprocess.CompletedProcess) -> re.Match:
  assert result.returncode == 0, result.stdout + result.stderr
  match = re.search(r"start-up: import [\d.]+ s, init [\d.]+ s .*first step after [\d.]+ s; "
                    r"of which trace [\d.]+ s, compile [\d.]+ s \((\d+) programs, "
                    r"(?:(\d+) loaded from the cache (\S+)|no persistent cache)\)", result.stdout)
  assert match, result.stdout
  return match


def _params(workdir: pathlib.Path) -> dict[str, np.ndarray]:
  trainer = train.Trainer.open_finished(workdir)
  trainer.close()
  leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(trainer.model)))
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


@pytest.mark.slow
def test_a_second_run_loads_its_programs_from_the_cache_with_the_same_bits(tmp_path):
  env = _clean_env(XDG_CACHE_HOME=str(tmp_path / "xdg"))
  cache = tmp_path / "xdg" / "jax-ai-stack" / "xla"
  cold = _startup(_train(tmp_path / "cold", env))
  assert cold.group(3) == str(cache)
  entries = compile_cache.count_entries(cache)
  assert entries >= 2  # At least the initialisation and the train step.
  warm = _startup(_train(tmp_path / "warm", env))
  assert int(warm.group(2)) >= 2 and int(warm.group(2)) > int(cold.group(2))
  assert compile_cache.count_entries(cache) == entries  # Nothing new to compile.
  cold_params, warm_params = _params(tmp_path / "cold"), _params(tmp_path / "warm")
  assert cold_params.keys() == warm_params.keys()
  for key, value in cold_params.items():
    assert value.tobytes() == warm_params[key].tobytes(), key


@pytest.mark.slow  # A cold compile in a subprocess (~40 s on 2 busy cores); the
# in-process test above checks the same switch.
def test_off_writes_no_cache_even_where_jax_s_variable_points(tmp_path):
  jax_dir = tmp_path / "jax-dir"
  env = _clean_env(XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_COMPILATION_CACHE_DIR=str(jax_dir))
  match = _startup(_train(tmp_path / "run", env, "train.compile_cache=off"))
  assert match.group(2) is None  # "no persistent cache"
  assert not jax_dir.exists() and not (tmp_path / "xdg" / "jax-ai-stack").exists()


def test_an_unusable_cache_path_is_one_line_exit_2_and_nothing_written(tmp_path):
  blocker = tmp_path / "a-file"
  blocker.write_text("x")
  result = _train(tmp_path / "run", _clean_env(), f"train.compile_cache={blocker}/xla")
  assert result.returncode == 2, result.stdout + result.stderr
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and "train.compile_cache: cannot create" in lines[0], result.stderr
  assert not (tmp_path / "run").exists() and blocker.read_text() == "x"


def test_resuming_with_another_cache_setting_starts_no_phase():
  saved = {"step": 3, "config": {"train": {"steps": 3, "compile_cache": "auto", "progress": True}}}
  quiet = phases.resume(saved, {"train": {"steps": 3, "compile_cache": "off", "progress": False}},
                        "w")
  assert quiet.started == [] and len(quiet.phases) == 1  # Neither changes a bit of the run.
  longer = phases.resume(saved, {"train": {"steps": 4, "compile_cache": "off"}}, "w")
  assert longer.started == [("train.steps", 3, 4)]
