"""scripts/check_extras_resolve.py: a resolution is compared with the row's pins (no network)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from jax_ai_stack import compat

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checker():
  sys.path.insert(0, str(ROOT / "scripts"))
  spec = importlib.util.spec_from_file_location("check_extras_resolve",
                                                ROOT / "scripts" / "check_extras_resolve.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules["check_extras_resolve"] = module
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def matrix() -> compat.Matrix:
  return compat.load_matrix(ROOT / compat.MATRIX_FILENAME)


def saved_report(row: compat.Row, **changes: str | None) -> dict:
  """A `pip install --dry-run --report -` report of the row's set (plus the project and a
  dependency the row does not name); `name=None` leaves a package out."""
  packages = {"jax-ai-stack": "0.1.0", "ml-dtypes": "0.5.3", **row.packages}
  for name, version in changes.items():
    packages[name.replace("_", "-")] = version
  return {"version": "1", "install": [{"metadata": {"name": n, "version": v}}
                                      for n, v in packages.items() if v is not None]}


def test_a_resolution_to_the_pins_passes(checker, matrix):
  row = compat.find_row(matrix, "3.12", "cuda12")
  resolved = checker.report_versions(saved_report(row))
  assert checker.mismatches(row, resolved) == []


def test_a_different_or_missing_package_is_named(checker, matrix):
  row = compat.find_row(matrix, "3.12", "cuda12")
  resolved = checker.report_versions(saved_report(row, jax_cuda12_pjrt="9.9.9", libtpu=None,
                                                  optax=None))
  problems = checker.mismatches(row, resolved)
  assert problems == [
      f"jax-cuda12-pjrt: pinned {row.packages['jax-cuda12-pjrt']}, pip resolves 9.9.9",
      f"optax: pinned {row.packages['optax']}, not in the resolution",
  ]


def test_the_requirement_asks_for_every_package_of_the_row(checker, matrix):
  row = compat.find_row(matrix, "3.11", "tpu")
  requirement = checker.requirement(matrix, row, project=pathlib.Path("/src"))
  extras = requirement.removeprefix("/src[").removesuffix("]").split(",")
  assert extras[0] == "tpu" and set(extras[1:]) <= set(matrix.extras)
  asked = {n for e in extras[1:] for n in matrix.extras[e]}
  core = set(row.packages) - matrix.optional_packages
  assert set(row.packages) <= asked | core
  assert asked <= set(row.packages)  # No extra whose packages the row does not pin.


def test_a_failed_resolution_is_one_problem(checker, matrix, monkeypatch):
  row = compat.find_row(matrix, "3.13", "cuda13")
  def fail(interpreter, requirements):
    raise checker.ResolutionError("pip could not resolve .[cuda13]: no matching distribution")
  monkeypatch.setattr(checker, "pip_report", fail)
  assert checker.check_row(matrix, row, pathlib.Path("python")) == [
      "pip could not resolve .[cuda13]: no matching distribution"]


def test_an_unknown_row_exits_2(checker, capsys):
  assert checker.main(["--row", "py3.99-cuda12"]) == 2
  assert "no row named py3.99-cuda12" in capsys.readouterr().err


def test_main_reports_each_row(checker, matrix, monkeypatch, capsys):
  monkeypatch.setattr(checker, "pyenv_interpreter",
                      lambda python: None if python == "3.13" else pathlib.Path("python"))
  def report(interpreter, requirements):
    row = next(r for r in matrix.rows if r.python == "3.11"
               and requirements[0] == checker.requirement(matrix, r))
    return saved_report(row, jax="0.0.1" if row.accelerator == "tpu" else row.packages["jax"])
  monkeypatch.setattr(checker, "pip_report", report)
  assert checker.main(["--row", "py3.11-cuda12", "--row", "py3.11-tpu",
                       "--row", "py3.13-cuda12"]) == 1
  out = capsys.readouterr().out
  assert "py3.11-cuda12: PASS" in out
  pinned = compat.find_row(matrix, "3.11", "tpu").packages["jax"]
  assert "py3.11-tpu: FAIL" in out and f"  jax: pinned {pinned}, pip resolves 0.0.1" in out
  assert "py3.13-cuda12: SKIPPED (no Python 3.13 under pyenv)" in out
