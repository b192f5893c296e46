"""Run the tests a pinned library ships in its wheel against this environment, module by module.

optax and grain install their own `*_test.py` files beside their code in site-packages. Run
here, against the versions our matrix pins together, they are the libraries' own proof that
the set works: a new failure on a row stands out from the known ones, each listed with its
reason in a known-failures file (`scripts/library_tests_known.yaml`).

    .venv/bin/python scripts/library_tests.py --packages optax,grain \\
        --modules 'optax/_src/transform_test.py,grain/*/map_test.py' \\
        --known scripts/library_tests_known.yaml --timeout 300

Each module runs in its own `python -m pytest` (this interpreter: the environment under test),
from an empty temporary directory with an empty `pytest.ini`, so neither our `conftest.py` nor
our `pyproject.toml`'s pytest settings apply; test ids are relative to site-packages
(`optax/_src/alias_test.py::AliasTest::test_x`). This file is also the pytest plugin each run
loads (`-p library_tests`): it records every test's outcome, and marks absl's flags parsed
with their defaults, as `absltest.main()` would (grain's tests read flags; under plain pytest
they raise `UnparsedFlagAccessError`).

What the libraries' tests import, beyond the libraries themselves (optax 0.2.8, grain 0.2.18):
pytest, absl-py (`absltest`, `parameterized`) and numpy for both; scipy and scikit-learn
(the `dev` extra) for optax's `alias_test`, `linesearch_test` and a few others; cloudpickle,
attrs, etils, portpicker and prometheus_client (grain's own dependencies) for grain, plus
pyarrow (the `dev` extra) for its Parquet source, tensorflow (the `tfds` extra) for its TFRecord
source and `parameterized` (not installed by any extra: its `data_loader_test` fails to
collect without it). chex is not needed: optax 0.2.8's tests use `optax._src.test_utils`.

Writes `<out>/library_tests.json` (each module's counts, seconds, status and failures; the
versions tested) and `<out>/library_tests.txt` (one line a module), and prints the latter.
Exit status: 0 when every failure, error, timeout or crash is in the known file; 1 when one
is not; 2 for bad arguments (an unknown package, no module matched, a malformed known file).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import time

_RECORD_ENV = "LIBRARY_TESTS_RECORD"
"""The JSON-lines file a pytest run started by this script appends its outcomes to."""

FAILING = ("failed", "error", "timeout", "crash")
"""Outcomes that fail a module unless the known file lists them."""


# ---------------------------------------------------------------------------------------------
# The pytest plugin (loaded in each module's run by `-p library_tests`).


def pytest_configure(config):
  del config
  try:
    from absl import flags
  except ImportError:
    return
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # Defaults, as absltest.main() gives them.


def _record(nodeid: str, outcome: str, message: str = "") -> None:
  path = os.environ.get(_RECORD_ENV)
  if path:
    with open(path, "a", encoding="utf-8") as f:
      f.write(json.dumps({"id": nodeid, "outcome": outcome, "message": message[:500]}) + "\n")


def _message(report) -> str:
  crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
  if crash is not None:
    return crash.message.strip()
  text = getattr(report, "longreprtext", "") or ""
  return text.strip().splitlines()[-1] if text.strip() else ""


def pytest_runtest_logreport(report):
  if hasattr(report, "wasxfail"):
    outcome = "xfailed" if report.skipped else "xpassed"
  elif report.failed:
    outcome = "failed" if report.when == "call" else "error"
  elif report.skipped:
    outcome = "skipped"
  elif report.when == "call":
    outcome = "passed"
  else:
    return  # A setup or teardown that passed says nothing of its own.
  _record(report.nodeid, outcome, _message(report) if report.failed else "")


def pytest_collectreport(report):
  if report.failed:
    _record(report.nodeid, "error", _message(report))


# ---------------------------------------------------------------------------------------------
# Running modules and reading their outcomes.

_RANK = {"passed": 0, "skipped": 0, "xfailed": 0, "xpassed": 0, "failed": 2, "error": 3}


@dataclasses.dataclass(frozen=True)
class Module:
  """A test file a package ships: `name` is its path relative to `root` (site-packages)."""

  package: str
  root: pathlib.Path
  name: str


@dataclasses.dataclass
class Result:
  module: Module
  seconds: float
  returncode: int | None
  tests: dict[str, tuple[str, str]]
  """Test id -> (outcome, message): the worst of its reports (subtests included)."""


def find_modules(packages: list[str], patterns: list[str]) -> list[Module]:
  """The `*_test.py` and `test_*.py` files of `packages` whose path matches one of `patterns`."""
  modules = []
  for package in packages:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
      raise SystemExit(f"library_tests: package {package!r} is not installed in {sys.executable}")
    for location in spec.submodule_search_locations:
      directory = pathlib.Path(location)
      root = directory.parent
      for path in sorted(directory.rglob("*.py")):
        if not (path.name.endswith("_test.py") or path.name.startswith("test_")):
          continue
        name = path.relative_to(root).as_posix()
        if not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns):
          modules.append(Module(package, root, name))
  return modules


def read_outcomes(lines: list[str]) -> dict[str, tuple[str, str]]:
  """Each test's worst outcome from the plugin's JSON lines (a test reports once per phase and
  once per subtest: a failed subtest fails its test)."""
  tests: dict[str, tuple[str, str]] = {}
  for line in lines:
    if not line.strip():
      continue
    entry = json.loads(line)
    previous = tests.get(entry["id"])
    if previous is None or _RANK[entry["outcome"]] > _RANK[previous[0]]:
      tests[entry["id"]] = (entry["outcome"], entry["message"])
  return tests


def run_module(module: Module, timeout: float, workdir: pathlib.Path) -> Result:
  """`python -m pytest` on one module, from `workdir`, killed with its children after `timeout`."""
  record = workdir / "record.jsonl"
  record.write_text("")
  ini = workdir / "pytest.ini"
  ini.write_text("[pytest]\n")
  env = dict(os.environ)
  env[_RECORD_ENV] = str(record)
  here = str(pathlib.Path(__file__).resolve().parent)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
  command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "library_tests",
             "-c", str(ini), "--rootdir", str(module.root), "--confcutdir", str(module.root),
             str(module.root / module.name)]
  start = time.monotonic()
  process = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
  try:
    output, _ = process.communicate(timeout=timeout)
    returncode: int | None = process.returncode
  except subprocess.TimeoutExpired:
    os.killpg(process.pid, signal.SIGKILL)  # Its own session: the test's children go too.
    output, _ = process.communicate()
    returncode = None
  seconds = time.monotonic() - start
  tests = read_outcomes(record.read_text().splitlines())
  if returncode is None:
    tests[module.name] = ("timeout", f"still running after {timeout:g} s")
  elif returncode not in (0, 1, 5) and not any(o in FAILING for o, _ in tests.values()):
    tail = output.decode(errors="replace").strip().splitlines()[-1:] or [""]
    tests[module.name] = ("crash", f"pytest exited {returncode}: {tail[0]}")
  return Result(module, seconds, returncode, tests)


# ---------------------------------------------------------------------------------------------
# Known failures and the report.


def load_known(path: pathlib.Path | None) -> dict[str, str]:
  """Test id (or fnmatch pattern over ids) -> the reason it fails on our pins."""
  if path is None:
    return {}
  import yaml

  try:
    known = yaml.safe_load(path.read_text()) or {}
  except (OSError, yaml.YAMLError) as e:
    raise SystemExit(f"library_tests: cannot read known failures {path}: {e}") from None
  if not isinstance(known, dict):
    raise SystemExit(f"library_tests: {path} must map test ids to reasons")
  for test_id, reason in known.items():
    if not isinstance(reason, str) or not reason.strip():
      raise SystemExit(f"library_tests: {path}: {test_id!r} needs a reason (a non-empty string)")
  return {str(k): v.strip() for k, v in known.items()}


def known_reason(test_id: str, known: dict[str, str]) -> str | None:
  if test_id in known:
    return known[test_id]
  for pattern, reason in known.items():
    if fnmatch.fnmatchcase(test_id, pattern):
      return reason
  return None


def summarize(results: list[Result], known: dict[str, str]) -> dict:
  """The JSON report: per module its counts, status and failures (known ones with reason)."""
  modules, unknown, matched = [], [], set()
  for result in results:
    counts: dict[str, int] = {}
    failures = []
    for test_id, (outcome, message) in sorted(result.tests.items()):
      counts[outcome] = counts.get(outcome, 0) + 1
      if outcome in FAILING:
        reason = known_reason(test_id, known)
        failures.append({"id": test_id, "outcome": outcome, "message": message, "known": reason})
        if reason is None:
          unknown.append(test_id)
        else:
          matched.update(k for k in known if k == test_id or fnmatch.fnmatchcase(test_id, k))
    new = [f for f in failures if f["known"] is None]
    status = "FAIL" if new else ("KNOWN" if failures else "PASS")
    modules.append({"module": result.module.name, "package": result.module.package,
                    "status": status, "seconds": round(result.seconds, 1), "counts": counts,
                    "failures": failures})
  names = [r.module.name for r in results]
  stale = sorted(k for k in known if k not in matched
                 and any(k.split("::")[0] == n or fnmatch.fnmatchcase(n, k.split("::")[0])
                         for n in names))
  versions = {}
  for package in sorted({r.module.package for r in results} | {"jax", "jaxlib", "numpy"}):
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      versions[package] = None
  return {"python": platform.python_version(), "versions": versions, "modules": modules,
          "new_failures": unknown, "known_not_failing": stale}


def text_table(report: dict) -> str:
  """One line a module (passed, failing, skipped, seconds, status), then the totals."""
  width = max([len(m["module"]) for m in report["modules"]] + [6])
  lines = [f"{'module':<{width}}  {'passed':>6} {'failed':>6} {'skipped':>7} {'seconds':>7}  status"]
  for m in report["modules"]:
    c = m["counts"]
    bad = sum(c.get(o, 0) for o in FAILING)
    known = sum(1 for f in m["failures"] if f["known"] is not None)
    status = m["status"] + (f" ({known} known)" if known else "")
    lines.append(f"{m['module']:<{width}}  {c.get('passed', 0):>6} {bad:>6} "
                 f"{c.get('skipped', 0):>7} {m['seconds']:>7.1f}  {status}")
  totals = {o: sum(m["counts"].get(o, 0) for m in report["modules"])
            for o in ("passed", *FAILING, "skipped")}
  counted = ", ".join(f"{n} {o}" for o, n in totals.items() if n or o == "passed")
  lines.append(f"{len(report['modules'])} modules: {counted}; "
               f"{len(report['new_failures'])} not in the known failures")
  lines += [f"NEW FAILURE: {test_id}" for test_id in report["new_failures"]]
  lines += [f"known failure that passed (remove it from the list?): {test_id}"
            for test_id in report["known_not_failing"]]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--packages", default="optax,grain",
                      help="comma-separated packages whose shipped tests run (default: %(default)s)")
  parser.add_argument("--modules", default="",
                      help="comma-separated globs over module paths relative to site-packages "
                           "(e.g. 'optax/_src/*_test.py'); default: every module")
  parser.add_argument("--timeout", type=float, default=600.0,
                      help="seconds per module (default: %(default)s)")
  parser.add_argument("--known", type=pathlib.Path, help="YAML file: test id (or glob) -> reason")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/library-tests"),
                      help="folder for library_tests.json and library_tests.txt")
  args = parser.parse_args(argv)
  packages = [p.strip() for p in args.packages.split(",") if p.strip()]
  patterns = [p.strip() for p in args.modules.split(",") if p.strip()]
  known = load_known(args.known)
  modules = find_modules(packages, patterns)
  if not modules:
    print(f"library_tests: no test module of {', '.join(packages)} matches {args.modules!r}",
          file=sys.stderr)
    return 2
  results = []
  with tempfile.TemporaryDirectory(prefix="library-tests-") as workdir:
    for module in modules:
      result = run_module(module, args.timeout, pathlib.Path(workdir))
      print(f"{module.name}: {len(result.tests)} tests, {result.seconds:.1f} s", flush=True)
      results.append(result)
  report = summarize(results, known)
  table = text_table(report)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "library_tests.json").write_text(json.dumps(report, indent=1) + "\n")
  (args.out / "library_tests.txt").write_text(table + "\n")
  print(table)
  return 1 if report["new_failures"] else 0


if __name__ == "__main__":
  sys.exit(main())
