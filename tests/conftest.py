"""Test-wide settings: CPU only, and a persistent XLA compilation cache per test worker.

Many tests build the same tiny model again (a resumed run is a new process or a new jit),
so caching compiled programs on disk keeps the suite fast on 2 cores. Subprocesses inherit
their worker's cache through the environment. Each pytest-xdist worker has its own: JAX
(0.10 to 0.12) writes an entry in place, so a process reading the key another is writing
gets a truncated program; tests that start processes compiling the same program at once (or
kill one) turn the cache off.

A worker's compiled programs are released at the end of a test file once they are many
(`_release_compiled_programs`).
XLA:CPU maps each program's code and data as regions of their own (about 3 maps a program)
and JAX's caches keep every program alive, so a worker's maps grow toward Linux's limit of
65,530 a process (vm.max_map_count; one worker had 24,400 twenty minutes into the suite).
Past it mmap fails: workers segfaulted in a compile and in a cache write, each late in a
long-lived worker or deep in a file of many programs. pytest-xdist reruns a dead worker's
file once (`--max-worker-restart 1` in pyproject.toml); a second death ends the run rather
than hang it, as it did CI's until its limit with more restarts allowed.
"""

import json
import os
import pathlib
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A compilation cache per pytest-xdist worker: JAX writes an entry in place (not to a
# temporary file renamed), so a worker reading what another is writing got a partial
# executable and died in XLA's deserializer (seen twice, in test_engine). The controller
# imports this file first and its environment reaches the workers: the folder is set
# again in each worker, unless the user set JAX_COMPILATION_CACHE_DIR before pytest.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ or "JAX_AI_STACK_TEST_CACHE" in os.environ:
  _cache_root = os.environ.setdefault(
      "JAX_AI_STACK_TEST_CACHE", os.path.join(tempfile.gettempdir(), "jax-ai-stack-test-cache"))
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
      _cache_root, os.environ.get("PYTEST_XDIST_WORKER", "main"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
"""The suite checks what programs compute, not how fast they run, and on 2 cores it spends
most of its time in XLA:CPU's LLVM: without its optimizing passes a tiny model's journey
compiles in about two thirds of the time (a family preset's journey 41 s -> 28 s)."""
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()


import pytest  # noqa: E402

DURATIONS_FILE = pathlib.Path(__file__).with_name("durations.json")
"""Each test's seconds (setup + call + teardown) in a whole-suite run on a CI-sized machine
(2 cores, pytest-xdist on both), written by `pytest --record-durations tests/durations.json`."""
SLOW_S = 3.0
"""A test that took longer in DURATIONS_FILE is marked `slow` at collection (unless it is marked
`every_row`): CI runs the suite minus `slow` on a second Python, where 3 s keeps that run near
seven minutes; a test not recorded yet can say `@pytest.mark.slow` itself."""

_durations: dict[str, float] = {}


def pytest_addoption(parser):
  parser.addoption("--record-durations", metavar="PATH",
                   help="write each test's seconds (setup + call + teardown) to PATH as JSON")


@pytest.hookimpl(tryfirst=True)  # Before `-m` deselects by marker.
def pytest_collection_modifyitems(items):
  recorded = json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.exists() else {}
  for item in items:
    if (recorded.get(item.nodeid, 0.0) > SLOW_S and item.get_closest_marker("every_row") is None
        and item.get_closest_marker("slow") is None):
      item.add_marker(pytest.mark.slow)


def pytest_runtest_logreport(report):
  _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
  path = (session.config.getoption("--record-durations")
          or os.environ.get("JAX_AI_STACK_RECORD_DURATIONS"))  # A run whose command is fixed.
  if path and not hasattr(session.config, "workerinput"):  # The controller sees every report.
    recorded = {nodeid: round(seconds, 1) for nodeid, seconds in sorted(_durations.items())}
    pathlib.Path(path).write_text(json.dumps(recorded, indent=0) + "\n")


MAPS_TO_RELEASE = 20_000
"""A worker whose memory maps pass this at the end of a test file frees its programs. (Freeing
after every file instead made the suite about twice as slow: each file then traced, lowered
and loaded again the programs an earlier one had in JAX's caches.)"""
MAPS_CEILING = 36_000
"""... and at the end of any test, past this: one file can add far more than a file's share
(test_families, every family's journey: a worker at 52,306 maps mid-file, with a cold
compilation cache), and CI lost a worker to a segfault in a compile there."""


def _release_where_maps_pass(limit: int) -> None:
  """JAX's caches cleared and the programs freed where this worker's memory maps pass
  `limit` (see the module)."""
  import gc
  import sys

  maps = pathlib.Path("/proc/self/maps")  # Linux's; elsewhere nothing is freed.
  if "jax" in sys.modules and maps.exists() and maps.read_bytes().count(b"\n") > limit:
    sys.modules["jax"].clear_caches()
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """After a test file, the programs freed where the worker's maps are many."""
  yield
  _release_where_maps_pass(MAPS_TO_RELEASE)


@pytest.fixture(autouse=True)
def _release_compiled_programs_near_the_limit():
  """After any test, the programs freed where the worker's maps near the kernel's limit."""
  yield
  _release_where_maps_pass(MAPS_CEILING)


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


@pytest.fixture
def engine_lengths(monkeypatch) -> list[int]:
  """The `max_len` (positions a slot holds) of each generation engine built in the test."""
  from jax_ai_stack.recipes.inference import engine as engine_lib

  lengths, built = [], engine_lib.Engine.__init__

  def record(self, *args, **kwargs):
    built(self, *args, **kwargs)
    lengths.append(self.max_len)

  monkeypatch.setattr(engine_lib.Engine, "__init__", record)
  return lengths
