"""The matrix is the single source of truth: pins, rows and installed versions agree."""

from __future__ import annotations

import pathlib
import sys
import tomllib

import pytest

from jax_ai_stack import compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
PINNED_LIBRARIES = (
    "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorstore", "qwix",
    "tokamax", "numpy",
)


@pytest.fixture(scope="module")
def matrix() -> compat.Matrix:
  return compat.load_matrix(ROOT / compat.MATRIX_FILENAME)


def test_pyproject_pins_are_generated_from_the_matrix(matrix):
  text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
  assert compat.replace_pyproject_block(text, compat.pyproject_block(matrix)) == text, (
      "pyproject.toml is stale: run `python scripts/sync_pins.py`"
  )


def test_pyproject_pins_are_exact_and_cover_the_stack(matrix):
  project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
  deps = project["dependencies"]
  for spec in deps:
    assert "==" in spec, f"not an exact pin: {spec}"
  names = {compat.canonical_name(spec.split("==")[0]) for spec in deps}
  assert set(PINNED_LIBRARIES) <= names
  for extra in ("cuda12", "cuda13", "tpu", "dev"):
    assert project["optional-dependencies"][extra], extra
  assert any(s.startswith("pytest==") for s in project["optional-dependencies"]["dev"])


def test_every_row_pins_every_library_exactly(matrix):
  for row in matrix.rows:
    assert set(PINNED_LIBRARIES) <= set(row.packages), row.name
    assert row.packages["jax"] == row.packages["jaxlib"], row.name


def test_rows_cover_each_python_and_accelerator(matrix):
  pythons = {r.python for r in matrix.rows}
  assert pythons == {"3.11", "3.12", "3.13"}
  for python in pythons:
    for accelerator in compat.ACCELERATORS:
      row = compat.find_row(matrix, python, accelerator)
      assert row.ci == (accelerator == "cpu"), row.name
      if not row.ci:
        assert row.reason


def test_accelerator_rows_add_plugins_at_the_jax_version(matrix):
  for row in matrix.rows:
    if row.accelerator.startswith("cuda"):
      plugin = f"jax-{row.accelerator}-plugin"
      assert row.packages[plugin] == row.packages["jax"], row.name


def test_jax_011_and_newer_only_on_python_312_and_up(matrix):
  for row in matrix.rows:
    major, minor = (int(x) for x in row.packages["jax"].split(".")[:2])
    if (major, minor) >= (0, 11):
      assert row.python >= "3.12", row.name


def test_running_environment_matches_its_row(matrix):
  row = compat.find_row(matrix)
  assert row.python == f"{sys.version_info.major}.{sys.version_info.minor}"
  statuses = {s.name: s.status for s in compat.compare(matrix, row)}
  # The test environment has `dev` installed; other extras (bench: torch) may be absent.
  optional = matrix.optional_packages - set(matrix.extras["dev"])
  different = {n: s for n, s in statuses.items()
               if s != "ok" and not (s == "absent" and n in optional)}
  assert not different, f"installed versions differ from row {row.name}: {different}"


def test_unknown_row_lists_the_rows(matrix):
  with pytest.raises(compat.RowNotFoundError, match=r"Python 3\.9.*3\.11/cpu"):
    compat.find_row(matrix, "3.9", "cpu")


def test_constraints_pin_every_package(matrix):
  row = compat.find_row(matrix, "3.12", "cuda12")
  lines = [l for l in compat.constraints_text(row).splitlines() if not l.startswith("#")]
  assert f"jax=={row.packages['jax']}" in lines
  assert f"jax-cuda12-plugin=={row.packages['jax']}" in lines
  assert len(lines) == len(row.packages)


@pytest.mark.parametrize(
    "text, message",
    [
        ("rows: [", "not valid YAML"),
        ("schema: 1\n", "no list under 'rows'"),
        ("rows:\n  - {name: a, python: '3.11', accelerator: gpu, ci: true, packages: {jax: '1'}}\n",
         "accelerator 'gpu'"),
        ("rows:\n  - {name: a, python: '3.11', accelerator: cpu, ci: true, packages: {jax: 0.1}}\n",
         "package 'jax' needs an exact version"),
        ("rows:\n  - {name: a, python: '3.11', accelerator: cpu, ci: true, packages: {jax: '0.4.*'}}\n",
         "package 'jax' needs an exact version"),
        ("rows:\n  - {name: a, python: '3.11', accelerator: cpu, ci: false, packages: {jax: '1'}}\n",
         "must say why"),
        ("rows:\n  - {name: a, python: '3.11', packages: {jax: '1'}}\n", "missing field"),
    ],
)
def test_malformed_matrix_names_the_file_and_problem(tmp_path, text, message):
  path = tmp_path / "m.yaml"
  path.write_text(text)
  with pytest.raises(compat.MatrixError, match=message) as info:
    compat.load_matrix(path)
  assert str(path) in str(info.value)


def test_missing_matrix_names_the_path(tmp_path):
  with pytest.raises(compat.MatrixError, match="not found"):
    compat.load_matrix(tmp_path / "nope.yaml")


def test_import_is_cheap():
  import subprocess

  code = (
      "import sys, jax_ai_stack; jax_ai_stack.__version__;"
      "heavy = [m for m in ('jax', 'flax', 'optax', 'grain', 'orbax') if m in sys.modules];"
      "print(heavy)"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"


def test_a_local_build_matches_a_pin_without_a_local_label():
  status = lambda pinned, installed: compat.PackageStatus("torch", pinned, installed, True).status  # noqa: E731
  assert status("2.13.0", "2.13.0+cpu") == "ok"  # What pip's ==2.13.0 accepts too.
  assert status("2.13.0+cpu", "2.13.0") == "different"
  assert status("2.13.0", "2.13.1+cpu") == "different"
  assert status("2.13", "2.13.0") == "ok" and status("1.0rc1", "1.0.0rc1") == "ok"  # As pip reads ==.
  assert status("1.0", "1.0rc1") == "different" and status("not-pep440", "not-pep440") == "ok"


def test_names_are_pep_503_normalised():
  assert compat.canonical_name("Orbax_Checkpoint") == "orbax-checkpoint"
  assert compat.canonical_name("jax.CUDA12__plugin") == "jax-cuda12-plugin"


def test_torch_is_only_in_the_bench_extra_of_the_benchmark_row(matrix):
  assert matrix.extras["bench"] == ("torch",)
  assert not any("torch" in names for extra, names in matrix.extras.items() if extra != "bench")
  assert [r.name for r in matrix.rows if "torch" in r.packages] == ["py3.11-cpu"]
