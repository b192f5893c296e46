"""Proposes the next tested row of compat_matrix.yaml for one Python.

  python scripts/propose_row.py --python 3.12            # resolve only (pip metadata)
  python scripts/propose_row.py --python 3.12 --install  # and test it in a scratch venv

Asks pip, with that Python's interpreter (pyenv's, or `--interpreter`), for the
newest releases of every package of the row's CPU set that install together
(`pip install --dry-run --ignore-installed --report -` with unpinned names), and
prints the row to paste into the matrix with each change from the current row.
With `--install` it installs that set and this checkout (`--no-deps`) into a
scratch venv, runs `jax-ai-stack doctor --strict` against a copy of the matrix
holding the proposed row, and the integration tests (`pytest -m integration`);
when a test fails, each changed package is put back to its current pin in turn
to name the one that breaks it. Exit status: 0 a row was proposed (and passed,
with --install), 1 resolution or a test failed, 2 bad input.

The resolution is one function of (names, interpreter) -> versions, so the tests
feed it a saved pip report instead of the network (`--report FILE` does the
same by hand).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jax_ai_stack import compat, yamlio  # noqa: E402

Resolver = Callable[[list[str]], dict[str, str]]


class ProposeError(Exception):
  """Bad input (no such row, no interpreter, an unreadable report): exit 2."""


class ResolutionError(Exception):
  """pip could not resolve the set, or left a package out: exit 1."""


# ---- pip --------------------------------------------------------------------------


def pyenv_interpreter(python: str) -> pathlib.Path | None:
  """The newest pyenv interpreter of `python` (X.Y), as .ci/run finds it; None if absent."""
  root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
  found = [pathlib.Path(p) for p in glob.glob(f"{root}/versions/{python}.*/bin/python")]
  found = [p for p in found if p.parent.parent.name.count(".") == 2
           and p.parent.parent.name.split(".")[2].isdigit()]
  if not found:
    return None
  return max(found, key=lambda p: tuple(int(x) for x in p.parent.parent.name.split(".")))


def pip_report(interpreter: str | os.PathLike, requirements: Iterable[str],
               extra_args: Iterable[str] = ()) -> dict:
  """pip's installation report for `requirements`, resolved for `interpreter` (no install)."""
  command = [str(interpreter), "-m", "pip", "install", "--dry-run", "--ignore-installed",
             "--quiet", "--disable-pip-version-check", "--report", "-",
             *extra_args, *requirements]
  result = subprocess.run(command, capture_output=True, text=True)
  if result.returncode != 0:
    message = (result.stderr.strip() or result.stdout.strip()).splitlines()
    raise ResolutionError("pip could not resolve " + " ".join(requirements) + ":\n  "
                          + "\n  ".join(message[-15:]))
  return json.loads(result.stdout)


def report_versions(report: Mapping) -> dict[str, str]:
  """{canonical name: version} of everything a pip report would install."""
  return {compat.canonical_name(item["metadata"]["name"]): item["metadata"]["version"]
          for item in report.get("install", [])}


def pip_resolver(interpreter: str | os.PathLike) -> Resolver:
  """Resolves unpinned names to the newest consistent versions for `interpreter`."""
  return lambda names: report_versions(pip_report(interpreter, names))


# ---- the proposal -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Proposal:
  """The resolved set for a row, and how it differs from the row."""

  row: compat.Row
  packages: dict[str, str]
  changes: dict[str, tuple[str, str]]
  """name -> (current pin, proposed version), only where they differ."""


def propose(row: compat.Row, resolve: Resolver) -> Proposal:
  """The newest versions `resolve` finds for every package of `row`.

  Raises ResolutionError when the resolution leaves a package of the row out.
  """
  names = sorted(row.packages)
  resolved = resolve(names)
  missing = [n for n in names if n not in resolved]
  if missing:
    raise ResolutionError(f"the resolution has no version for {', '.join(missing)}")
  packages = {n: resolved[n] for n in names}
  changes = {n: (row.packages[n], v) for n, v in packages.items() if v != row.packages[n]}
  return Proposal(row, packages, changes)


def row_yaml(proposal: Proposal) -> str:
  """The proposed row as YAML for the `rows:` list, each change commented."""
  row = proposal.row
  lines = [f"  - name: {row.name}", f'    python: "{row.python}"',
           f"    accelerator: {row.accelerator}", f"    ci: {str(row.ci).lower()}",
           "    packages:"]
  for name, version in proposal.packages.items():
    was = proposal.changes.get(name)
    lines.append(f'      {name}: "{version}"' + (f"  # was {was[0]}" if was else ""))
  lines.append("    limitations: []  # re-check the current row's limitations")
  return "\n".join(lines)


def summary(proposal: Proposal) -> str:
  if not proposal.changes:
    return f"no changes: {proposal.row.name} already pins the newest releases"
  changed = ", ".join(f"{n} {old} -> {new}" for n, (old, new) in proposal.changes.items())
  return f"{len(proposal.changes)} change(s) from {proposal.row.name}: {changed}"


# ---- testing a proposal ------------------------------------------------------------


def attribute(failing: list[str], changes: Mapping[str, tuple[str, str]],
              pin: Callable[[str, str], None],
              run_tests: Callable[[list[str]], list[str]]) -> dict[str, list[str]]:
  """Which changed package breaks which failing test.

  For each changed package in turn: `pin(name, old)`, rerun the failing tests
  (`run_tests(tests) -> still failing`), `pin(name, new)` back. A test that
  passes with the old version is that package's. Tests no single package
  explains are listed under "(several packages or none)".
  """
  blamed: dict[str, list[str]] = {}
  unexplained = set(failing)
  for name, (old, new) in changes.items():
    pin(name, old)
    try:
      fixed = [t for t in failing if t not in run_tests(failing)]
    finally:
      pin(name, new)
    if fixed:
      blamed[name] = fixed
      unexplained -= set(fixed)
  if unexplained:
    blamed["(several packages or none)"] = sorted(unexplained)
  return blamed


def matrix_with(proposal: Proposal, matrix_path: pathlib.Path, out: pathlib.Path) -> None:
  """A copy of the matrix whose row `proposal.row.name` pins the proposed set."""
  import yaml

  data = yamlio.read_yaml(matrix_path)
  for raw in data["rows"]:
    if raw["name"] == proposal.row.name:
      raw["packages"] = dict(proposal.packages)
  data.pop("_sets", None)
  data.pop("_limits", None)
  out.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


class ScratchVenv:
  """A throwaway venv of `interpreter` holding a proposed set and this checkout."""

  def __init__(self, interpreter: pathlib.Path, directory: pathlib.Path):
    self.directory = directory
    self.bin = directory / "bin"
    subprocess.run([str(interpreter), "-m", "venv", str(directory)], check=True)
    self.pip("install", "-q", "--upgrade", "pip")

  def pip(self, *args: str) -> None:
    subprocess.run([str(self.bin / "python"), "-m", "pip", "--disable-pip-version-check",
                    *args], check=True)

  def install(self, packages: Mapping[str, str]) -> None:
    self.pip("install", "-q", *(f"{n}=={v}" for n, v in packages.items()))
    self.pip("install", "-q", "--no-deps", str(ROOT))

  def pin(self, name: str, version: str) -> None:
    self.pip("install", "-q", "--no-deps", f"{name}=={version}")

  def failing_tests(self, tests: list[str] | None, workdir: pathlib.Path) -> list[str]:
    """Node ids of the failing integration tests (all of them, or only `tests`)."""
    report = workdir / "pytest-report.txt"
    targets = tests or [str(ROOT / "tests")]
    subprocess.run([str(self.bin / "pytest"), "-p", "no:cacheprovider", "-q", "-rf",
                    "-m", "integration", *targets], cwd=workdir,
                   stdout=report.open("w"), stderr=subprocess.STDOUT,
                   env=dict(os.environ, JAX_PLATFORMS="cpu"))
    text = report.read_text(encoding="utf-8")
    print(text[-3000:], end="")
    return [line.split()[1] for line in text.splitlines() if line.startswith("FAILED ")]


def check_installed(proposal: Proposal, interpreter: pathlib.Path,
                    matrix_path: pathlib.Path) -> int:
  """Installs and tests the proposal in a scratch venv; prints what failed; 0 if all passed."""
  with tempfile.TemporaryDirectory(prefix="propose-row-") as tmp:
    tmp = pathlib.Path(tmp)
    venv = ScratchVenv(interpreter, tmp / "venv")
    print(f"installing the proposed set into {venv.directory} ...", flush=True)
    venv.install(proposal.packages)
    matrix = tmp / "compat_matrix.yaml"
    matrix_with(proposal, matrix_path, matrix)
    doctor = subprocess.run([str(venv.bin / "jax-ai-stack"), "doctor", "--strict",
                             "--matrix", str(matrix)], env=dict(os.environ, JAX_PLATFORMS="cpu"))
    print("running the integration tests (pytest -m integration) ...", flush=True)
    failing = venv.failing_tests(None, tmp)
    failed = doctor.returncode != 0
    if doctor.returncode:
      print(f"FAILED: jax-ai-stack doctor --strict exited {doctor.returncode}")
    if failing:
      failed = True
      print(f"FAILED: {len(failing)} integration test(s); finding the package of each ...")
      blamed = attribute(failing, proposal.changes, venv.pin,
                         lambda tests: venv.failing_tests(tests, tmp))
      for name, tests in blamed.items():
        was = proposal.changes.get(name)
        which = f"{name} {was[0]} -> {was[1]}" if was else name
        print(f"  {which} breaks: {', '.join(tests)}")
    if not failed:
      print("PASS: doctor --strict and the integration tests pass with the proposed set")
    return int(failed)


# ---- command line -------------------------------------------------------------------


def main(argv: list[str] | None = None, *, resolver: Resolver | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--python", required=True, help="the row's Python, X.Y")
  parser.add_argument("--interpreter", help="that Python's executable (default: pyenv's)")
  parser.add_argument("--matrix", default=str(ROOT / compat.MATRIX_FILENAME))
  parser.add_argument("--report", help="a saved `pip install --dry-run --report` JSON to use "
                                       "instead of asking pip")
  parser.add_argument("--install", action="store_true",
                      help="install the set in a scratch venv, run doctor and the integration tests")
  args = parser.parse_args(argv)
  try:
    return _run(args, resolver)
  except ProposeError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except ResolutionError as e:
    print(f"FAILED: {e}", file=sys.stderr)
    return 1


def _run(args: argparse.Namespace, resolver: Resolver | None) -> int:
  try:
    matrix = compat.load_matrix(args.matrix)
    row = compat.find_row(matrix, args.python, "cpu")
  except (compat.MatrixError, compat.RowNotFoundError) as e:
    raise ProposeError(str(e)) from None
  interpreter = pathlib.Path(args.interpreter) if args.interpreter else pyenv_interpreter(args.python)
  if resolver is None and args.report:
    try:
      saved = json.loads(pathlib.Path(args.report).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
      raise ProposeError(f"--report {args.report}: not a readable pip report ({e})") from None
    resolver = lambda names: report_versions(saved)  # noqa: E731
  needs_interpreter = resolver is None or args.install
  if needs_interpreter and (interpreter is None or not interpreter.exists()):
    raise ProposeError(f"no Python {args.python} interpreter: install it with pyenv or pass "
                       "--interpreter")
  proposal = propose(row, resolver or pip_resolver(interpreter))
  print(f"# proposed row for Python {row.python} (cpu); "
        f"resolved {'from ' + args.report if args.report else 'by pip for ' + str(interpreter)}")
  print(row_yaml(proposal))
  print(f"# {summary(proposal)}")
  if args.install:
    return check_installed(proposal, interpreter, pathlib.Path(args.matrix))
  return 0


if __name__ == "__main__":
  sys.exit(main())
