"""Test-wide settings: CPU only, and one persistent XLA compilation cache.

Many tests build the same tiny model again (a resumed run is a new process or a
new jit), so caching compiled programs on disk keeps the suite fast on 2 cores.
Subprocesses started by tests inherit the cache through the environment.
"""

import json
import os
import pathlib
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jax-ai-stack-test-cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


import pytest  # noqa: E402

DURATIONS_FILE = pathlib.Path(__file__).with_name("durations.json")
"""Each test's seconds (setup + call + teardown) in a whole-suite run on a CI-sized machine
(2 cores, pytest-xdist on both), written by `pytest --record-durations tests/durations.json`."""
SLOW_S = 10.0
"""A test that takes longer is marked `slow` (test_markers.py checks it against DURATIONS_FILE)."""

_durations: dict[str, float] = {}


def pytest_addoption(parser):
  parser.addoption("--record-durations", metavar="PATH",
                   help="write each test's seconds (setup + call + teardown) to PATH as JSON")


def pytest_runtest_logreport(report):
  _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
  path = session.config.getoption("--record-durations")
  if path and not hasattr(session.config, "workerinput"):  # The controller sees every report.
    recorded = {nodeid: round(seconds, 1) for nodeid, seconds in sorted(_durations.items())}
    pathlib.Path(path).write_text(json.dumps(recorded, indent=0) + "\n")


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
