"""Reads every Markdown page of the site for MyST-NB: the notebooks through jupytext.

The notebooks under docs/notebooks are jupytext Markdown (what `tests/test_notebooks.py`
runs); MyST-NB reads only its own text format, and it picks a reader by file suffix, which
the guides share. So every page comes through here: one with jupytext's header becomes
jupytext's notebook, any other one notebook of a single Markdown cell, which MyST renders
as the page it is.
"""

import jupytext
import nbformat


def read(text: str) -> nbformat.NotebookNode:
  """The notebook of a page's `text` (see the module)."""
  if text.startswith("---\njupyter:"):
    return jupytext.reads(text, fmt="md")
  notebook = nbformat.v4.new_notebook()
  notebook.cells.append(nbformat.v4.new_markdown_cell(text))
  return notebook
