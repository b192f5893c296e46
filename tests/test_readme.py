"""README's promises: its commands are the ones CI runs, its tables are the matrix's; the
examples of the training guide (docs/training.md) run."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
TRAINING = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
INSTALL = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["main", "test"])
def test_ci_reads_both_commands_from_the_readme(name):
  command = subprocess.run(
      [sys.executable, str(ROOT / ".ci" / "readme_command.py"), name],
      capture_output=True, text=True, check=True,
  ).stdout.strip()
  assert command.startswith("python3 -m venv .venv && ")
  assert ("jax-ai-stack train" if name == "main" else "pytest") in command


@pytest.mark.slow
def test_notebook_example_runs(tmp_path, monkeypatch):
  code = re.search(r"<!-- notebook example.*?-->\s*```python\n(.*?)```", TRAINING, re.S).group(1)
  monkeypatch.chdir(tmp_path)
  namespace: dict = {}
  exec(compile(code, "docs/training.md", "exec"), namespace)  # noqa: S102 - our own docs.
  assert namespace["metrics"]["step"] == 20
  assert (tmp_path / "runs" / "notebook" / "loss.png").exists()
  from flax import nnx

  assert isinstance(namespace["model"], nnx.Module)
  assert isinstance(namespace["optimizer"], nnx.Optimizer)


def test_own_model_example_runs(tmp_path, monkeypatch):
  code = re.search(r"<!-- own model example.*?-->\s*```python\n(.*?)```", TRAINING, re.S).group(1)
  monkeypatch.chdir(tmp_path)
  namespace: dict = {}
  exec(compile(code, "docs/training.md", "exec"), namespace)  # noqa: S102 - our own docs.
  finished = namespace["finished"]
  try:
    assert namespace["metrics"]["step"] == finished.step == 200
    assert namespace["metrics"]["eval_loss"] < 0.3  # It learns the quadrants.
    assert finished.config.model.settings == {"width": 64}
  finally:
    finished.close()
  assert (tmp_path / "runs" / "mine" / "loss.png").exists()


def test_readme_table_matches_the_matrix():
  from jax_ai_stack import compat

  columns = ["jax", "flax", "optax", "orbax-checkpoint", "grain", "tensorstore", "qwix",
             "tokamax", "numpy"]
  for row in compat.load_matrix(ROOT / compat.MATRIX_FILENAME).rows:
    if row.accelerator != "cpu":
      continue
    line = next(l for l in README.splitlines() if l.startswith(f"| Python {row.python}, cpu |"))
    cells = [c.strip() for c in line.strip("|").split("|")][1:len(columns) + 1]
    assert cells[0] == f"{row.packages['jax']}", row.name
    assert cells == [row.packages[c] for c in columns], row.name


def test_the_upstream_table_is_the_matrix_s():
  """docs/install.md's "Coming from upstream's jax-ai-stack": upstream's pins and each
  row's, for every package upstream pins; every one of them is pinned on every row (a
  superset)."""
  from jax_ai_stack import compat

  matrix = compat.load_matrix(ROOT / compat.MATRIX_FILENAME)
  upstream = matrix.upstream
  section = INSTALL.split("## Coming from upstream's jax-ai-stack")[1].split("\n## ")[0]
  assert f"jax-ai-stack=={upstream.version}" in section
  cpu = {row.python: row.packages for row in matrix.rows if row.accelerator == "cpu"}
  assert cpu["3.12"] == cpu["3.13"]  # One column for both.
  for row in matrix.rows:
    assert set(upstream.pins) <= set(row.packages), row.name
  extra_of = {name: extra for extra, names in matrix.extras.items() if extra == "tfds"
              for name in names}
  for name, version in upstream.pins.items():
    label = f"{name} (`{extra_of[name]}`)" if name in extra_of else name
    line = next((l for l in section.splitlines() if l.startswith(f"| {label} |")), None)
    assert line is not None, f"{name}: no line in docs/install.md's upstream table"
    cells = [c.strip() for c in line.strip("|").split("|")][1:]
    assert cells == [version, cpu["3.11"][name], cpu["3.12"][name]], name
