"""scripts/propose_row.py: the proposed row, its changes and who breaks what (no network)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

from jax_ai_stack import compat, yamlio

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def propose_row():
  spec = importlib.util.spec_from_file_location("propose_row", ROOT / "scripts" / "propose_row.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules["propose_row"] = module  # Its dataclasses look their module up.
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def row() -> compat.Row:
  return compat.find_row(compat.load_matrix(ROOT / compat.MATRIX_FILENAME), "3.12", "cpu")


def saved_report(packages: dict[str, str]) -> dict:
  """The shape of `pip install --dry-run --report -` output (pip 22.2+), names as on PyPI."""
  return {"version": "1", "pip_version": "25.0", "install": [
      {"download_info": {"url": f"https://files.example/{n}-{v}.whl"}, "is_direct": False,
       "requested": True, "metadata": {"name": n.replace("-", "_").title(), "version": v}}
      for n, v in packages.items()]}


def newer(row, **changes) -> dict[str, str]:
  return {**row.packages, **{name.replace("_", "-"): v for name, v in changes.items()},
          "some-new-dependency": "1.0"}


def test_report_versions_uses_canonical_names(propose_row):
  report = saved_report({"orbax-checkpoint": "0.13.0", "PyYAML": "6.1"})
  assert propose_row.report_versions(report) == {"orbax-checkpoint": "0.13.0", "pyyaml": "6.1"}


def test_propose_lists_each_change_from_the_row(propose_row, row):
  resolved = newer(row, jax="0.13.0", optax="0.3.0")
  proposal = propose_row.propose(row, lambda names: resolved)
  assert proposal.changes == {"jax": (row.packages["jax"], "0.13.0"),
                              "optax": (row.packages["optax"], "0.3.0")}
  assert set(proposal.packages) == set(row.packages)  # New dependencies are not pinned.
  text = propose_row.row_yaml(proposal)
  assert f'jax: "0.13.0"  # was {row.packages["jax"]}' in text
  assert f'flax: "{row.packages["flax"]}"\n' in text
  assert propose_row.summary(proposal).startswith("2 change(s) from py3.12-cpu: jax ")


def test_proposed_row_is_a_valid_matrix_row(propose_row, row, tmp_path):
  proposal = propose_row.propose(row, lambda names: newer(row, jax="0.13.0"))
  matrix = tmp_path / "compat_matrix.yaml"
  matrix.write_text("schema: 1\nrows:\n" + propose_row.row_yaml(proposal) + "\n")
  parsed = compat.load_matrix(matrix).rows[0]
  assert parsed.packages == proposal.packages and parsed.name == row.name


def test_a_package_left_out_of_the_resolution_fails(propose_row, row):
  resolved = {n: v for n, v in row.packages.items() if n != "tokamax"}
  with pytest.raises(propose_row.ResolutionError, match="tokamax"):
    propose_row.propose(row, lambda names: resolved)


def test_main_prints_the_row_from_a_saved_report(propose_row, row, tmp_path, capsys):
  report = tmp_path / "report.json"
  report.write_text(json.dumps(saved_report(newer(row, grain="0.3.0"))))
  assert propose_row.main(["--python", "3.12", "--report", str(report)]) == 0
  out = capsys.readouterr().out
  assert "  - name: py3.12-cpu\n" in out
  assert f'grain: "0.3.0"  # was {row.packages["grain"]}' in out
  assert "1 change(s) from py3.12-cpu: grain" in out


def test_main_with_an_injected_resolver_and_no_changes(propose_row, row, capsys):
  assert propose_row.main(["--python", "3.12"], resolver=lambda names: dict(row.packages)) == 0
  assert "no changes: py3.12-cpu already pins the newest releases" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--python", "2.7"], "no row for Python 2.7"),
    (["--python", "3.12", "--report", "missing.json"], "not a readable pip report"),
    (["--python", "3.12", "--interpreter", "/nonexistent/python"], "no Python 3.12 interpreter"),
])
def test_bad_input_exits_2_naming_it(propose_row, argv, message, capsys):
  assert propose_row.main(argv) == 2
  assert message in capsys.readouterr().err


def test_resolution_failure_exits_1(propose_row, row, capsys):
  def fail(names):
    raise propose_row.ResolutionError("pip could not resolve jax")
  assert propose_row.main(["--python", "3.12"], resolver=fail) == 1
  assert "FAILED: pip could not resolve jax" in capsys.readouterr().err


def test_attribute_names_the_package_that_breaks_each_test(propose_row):
  installed = {"jax": "new", "optax": "new", "grain": "new"}
  def run_tests(tests):  # test_a breaks with the new jax, test_b with either new optax or new grain.
    broken = {"test_a": installed["jax"] == "new",
              "test_b": installed["optax"] == "new" or installed["grain"] == "new"}
    return [t for t in tests if broken[t]]
  pins = []
  def pin(name, version):
    pins.append((name, version))
    installed[name] = version
  changes = {"jax": ("old", "new"), "optax": ("old", "new"), "grain": ("old", "new")}
  blamed = propose_row.attribute(["test_a", "test_b"], changes, pin, run_tests)
  assert blamed == {"jax": ["test_a"], "(several packages or none)": ["test_b"]}
  assert installed == {"jax": "new", "optax": "new", "grain": "new"}  # Every pin put back.
  assert pins[:2] == [("jax", "old"), ("jax", "new")]


def test_matrix_with_the_proposal_keeps_other_rows(propose_row, row, tmp_path):
  proposal = propose_row.propose(row, lambda names: newer(row, jax="0.13.0"))
  out = tmp_path / "matrix.yaml"
  propose_row.matrix_with(proposal, ROOT / compat.MATRIX_FILENAME, out)
  matrix = compat.load_matrix(out)
  assert compat.find_row(matrix, "3.12", "cpu").packages["jax"] == "0.13.0"
  original = compat.load_matrix(ROOT / compat.MATRIX_FILENAME)
  assert ([r.packages for r in matrix.rows if r.name != row.name]
          == [r.packages for r in original.rows if r.name != row.name])
  assert "_sets" not in yamlio.read_yaml(out)  # Merge keys resolved: one flat mapping per row.
