"""Test-wide settings: CPU only, and one persistent XLA compilation cache.

Many tests build the same tiny model again (a resumed run is a new process or a
new jit), so caching compiled programs on disk keeps the suite fast on 2 cores.
Subprocesses started by tests inherit the cache through the environment.
"""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jax-ai-stack-test-cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
  """One uninterrupted tiny LM run; resumed runs must end with the same bits."""
  from jax_ai_stack.recipes import train
  from training_helpers import tiny_config

  workdir = tmp_path_factory.mktemp("reference")
  result = train.run(tiny_config(), workdir)
  return workdir, result


@pytest.fixture
def fresh_kernel_selection(monkeypatch):
  """No JAX_AI_STACK_ATTENTION from the caller's shell, and no cached choices."""
  from jax_ai_stack import kernels

  monkeypatch.delenv(kernels.ENV_VAR, raising=False)
  kernels.clear_cache()
  yield
  kernels.clear_cache()


def pytest_runtest_setup(item):
  """`@pytest.mark.cpu_backend` tests skip, saying why, where JAX runs on an accelerator."""
  if item.get_closest_marker("cpu_backend") is None:
    return
  import jax

  if jax.default_backend() != "cpu":
    pytest.skip(f"assumes JAX's CPU backend, and this process runs on {jax.default_backend()}: "
                "run it with JAX_PLATFORMS=cpu")
