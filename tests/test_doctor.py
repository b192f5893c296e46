"""`jax-ai-stack doctor` and `constraints`, through the real command line."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from jax_ai_stack import cli, compat

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _matrix_with(tmp_path, edit) -> str:
  """A copy of the real matrix with `edit(row)` applied to the running row."""
  data = yaml.safe_load((ROOT / compat.MATRIX_FILENAME).read_text())
  python = compat.running_python()
  for row in data["rows"]:
    if row["python"] == python and row["accelerator"] == "cpu":
      row["packages"] = dict(row["packages"])
      edit(row)
  path = tmp_path / "matrix.yaml"
  path.write_text(yaml.safe_dump(data))
  return str(path)


def test_doctor_strict_passes_on_the_pinned_install(capsys):
  assert cli.main(["doctor", "--strict"]) == 0
  out = capsys.readouterr().out
  assert f"py{compat.running_python()}-cpu" in out
  assert "backend cpu" in out
  assert "different" not in out and "missing" not in out


def test_doctor_json_reports_packages_and_devices(capsys):
  assert cli.main(["doctor", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  statuses = {p["name"]: p["status"] for p in report["packages"]}
  assert statuses["jax"] == "ok"
  assert report["jax"]["backend"] == "cpu"
  assert report["jax"]["devices"]


def test_doctor_strict_fails_on_a_different_version(tmp_path, capsys):
  matrix = _matrix_with(tmp_path, lambda row: row["packages"].update(numpy="1.0.0"))
  assert cli.main(["doctor", "--matrix", matrix]) == 0
  assert "different" in capsys.readouterr().out
  assert cli.main(["doctor", "--strict", "--matrix", matrix]) == 2
  err = capsys.readouterr().err
  installed = compat.installed_version("numpy")
  assert (f"error: numpy {installed} is installed; row py{compat.running_python()}-cpu pins "
          "numpy==1.0.0") in err
  assert "pip install -c constraints.txt numpy" in err


def test_doctor_names_what_upstream_s_pins_differ_in_and_what_the_row_gives(monkeypatch,
                                                                            capsys):
  """An environment holding upstream's jax-ai-stack pins: one table of each package at
  upstream's version and the row's instead; --strict refuses it, naming each."""
  matrix = compat.load_matrix(ROOT / compat.MATRIX_FILENAME)
  upstream = matrix.upstream.packages
  installed = compat.installed_version
  monkeypatch.setattr(compat, "installed_version", lambda name: upstream.get(name) or installed(name))
  assert cli.main(["doctor"]) == 0
  out = capsys.readouterr().out
  table = out.split("Differs from row ")[1]
  row = next(r for r in matrix.rows if r.python == compat.running_python()
             and r.accelerator == "cpu")
  differing = {n for n, v in upstream.items() if row.packages[n] != v}
  assert "orbax-export" not in differing and len(differing) >= 6  # All but orbax-export.
  for name in differing:
    assert re.search(rf"^{re.escape(name)} +{re.escape(upstream[name])} +"
                     rf"{re.escape(row.packages[name])} +upstream's jax-ai-stack "
                     rf"{matrix.upstream.version}$", table, re.M), name
  assert cli.main(["doctor", "--strict"]) == 2
  err = capsys.readouterr().err
  assert all(f"error: {name} {upstream[name]} is installed" in err for name in differing)


def test_doctor_names_a_missing_required_package(tmp_path, capsys):
  matrix = _matrix_with(tmp_path, lambda row: row["packages"].update({"not-a-real-pkg": "1.0"}))
  assert cli.main(["doctor", "--matrix", matrix]) == 2
  err = capsys.readouterr().err
  assert "not-a-real-pkg" in err and "not installed" in err


def test_doctor_does_not_fail_on_an_absent_optional_package(tmp_path, capsys):
  def add_optional(row):
    row["packages"]["not-a-real-extra"] = "1.0"

  path = _matrix_with(tmp_path, add_optional)
  data = yaml.safe_load(open(path))
  data["extras"]["dev"].append("not-a-real-extra")
  pathlib.Path(path).write_text(yaml.safe_dump(data))
  assert cli.main(["doctor", "--strict", "--matrix", path]) == 0
  assert "not installed (optional)" in capsys.readouterr().out


def test_doctor_malformed_matrix_is_one_line_and_exit_2(tmp_path, capsys):
  bad = tmp_path / "bad.yaml"
  bad.write_text("rows: [")
  assert cli.main(["doctor", "--matrix", str(bad)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and str(bad) in err[0]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--python", "3.9"], "no row for Python 3.9"),
        (["--accelerator", "rocm"], "unknown --accelerator 'rocm'"),
    ],
)
def test_constraints_bad_row_lists_choices(capsys, args, expected):
  assert cli.main(["constraints", *args]) == 2
  err = capsys.readouterr().err
  assert expected in err
  assert "3.12" in err or "cuda12" in err


def test_constraints_match_the_installed_versions(capsys):
  assert cli.main(["constraints"]) == 0
  pins = dict(
      line.split("==") for line in capsys.readouterr().out.splitlines() if "==" in line
  )
  assert pins["jax"] == compat.installed_version("jax")
  assert pins["flax"] == compat.installed_version("flax")


def test_console_script_runs_doctor():
  exe = shutil.which("jax-ai-stack", path=str(pathlib.Path(sys.executable).parent))
  assert exe, "the jax-ai-stack console script is not installed next to this Python"
  result = subprocess.run([exe, "doctor", "--strict"], capture_output=True, text=True)
  assert result.returncode == 0, result.stdout + result.stderr
