"""README's promises: its commands are the ones CI runs, its notebook example runs."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["main", "test"])
def test_ci_reads_both_commands_from_the_readme(name):
  command = subprocess.run(
      [sys.executable, str(ROOT / ".ci" / "readme_command.py"), name],
      capture_output=True, text=True, check=True,
  ).stdout.strip()
  assert command.startswith("python3 -m venv .venv && ")
  assert ("jax-ai-stack train" if name == "main" else "pytest") in command


def test_notebook_example_runs(tmp_path, monkeypatch):
  code = re.search(r"<!-- notebook example.*?-->\s*```python\n(.*?)```", README, re.S).group(1)
  monkeypatch.chdir(tmp_path)
  namespace: dict = {}
  exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README.
  assert namespace["metrics"]["step"] == 20
  assert (tmp_path / "runs" / "notebook" / "loss.png").exists()
  from flax import nnx

  assert isinstance(namespace["model"], nnx.Module)
  assert isinstance(namespace["optimizer"], nnx.Optimizer)


def test_own_model_example_runs(tmp_path, monkeypatch):
  code = re.search(r"<!-- own model example.*?-->\s*```python\n(.*?)```", README, re.S).group(1)
  monkeypatch.chdir(tmp_path)
  namespace: dict = {}
  exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README.
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
