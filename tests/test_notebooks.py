"""The notebooks under docs/notebooks run, top to bottom, at their tiny sizes.

Each is a jupytext Markdown file: read with jupytext, executed by nbclient on a
fresh `python3` kernel (the running interpreter's) in a temporary working dir,
so that the docs cannot drift from the code. A failing cell fails the test with
that cell's source and error.
"""

from __future__ import annotations

import os
import pathlib

import jupytext  # The `docs` extra (in `dev`): jupytext, nbclient, ipykernel.
import nbclient
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("*.md"))
# Over conftest.SLOW_S (tests/durations.json).
SLOW_NOTEBOOKS = {"quantize_and_finetune", "hugging_face", "your_own_model", "chat_and_preferences",
                  "bring_your_own_data", "getting_started", "scaling", "reinforcement_learning",
                  "evaluation"}
CELL_TIMEOUT_S = 300


def execute(path: pathlib.Path, workdir: pathlib.Path):
  """Runs every cell of `path` in `workdir`; returns the executed notebook."""
  notebook = jupytext.read(path)
  client = nbclient.NotebookClient(
      notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
      resources={"metadata": {"path": str(workdir)}},
  )
  client.execute(env=dict(os.environ, JAX_PLATFORMS="cpu"))
  return notebook


def test_there_are_notebooks():
  names = {p.name for p in NOTEBOOKS}
  assert {"getting_started.md", "bring_your_own_data.md", "kernels.md",
          "scaling.md", "quantize_and_finetune.md", "hugging_face.md", "your_own_model.md"} <= names


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW_NOTEBOOKS else p for p in NOTEBOOKS
], ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
  try:
    notebook = execute(path, tmp_path)
  except nbclient.exceptions.CellExecutionError as e:
    pytest.fail(f"{path.name}: a cell failed\n{e}", pytrace=False)
  cells = [c for c in notebook.cells if c.cell_type == "code"]
  assert cells, f"{path.name} has no code cells"
  assert all(c.get("execution_count") for c in cells), f"{path.name}: a cell did not run"
  # Each notebook ends with a cell that checks its own claims, then prints "checked".
  last = cells[-1].get("outputs", [])
  assert any("checked" in o.get("text", "") for o in last), f"{path.name}: no final check"


def test_a_failing_cell_names_its_error(tmp_path):
  """The runner itself: an error in a cell fails, naming the exception."""
  bad = tmp_path / "bad.md"
  bad.write_text("# bad\n\n```python\nraise ValueError('cell error 123')\n```\n",
                 encoding="utf-8")
  with pytest.raises(nbclient.exceptions.CellExecutionError, match="cell error 123"):
    execute(bad, tmp_path)
