"""The documentation site builds with Sphinx and MyST-NB, warnings as errors.

A broken link between pages, a page left out of every table of contents or a heading
anchor that does not exist fails here, as it would fail CI's build of the site.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import jupytext_pages  # noqa: E402 - docs/_ext is not a package.


def test_a_notebook_page_reads_as_its_notebook():
  notebook = jupytext_pages.read((DOCS / "notebooks" / "getting_started.md").read_text())
  kinds = {cell.cell_type for cell in notebook.cells}
  assert kinds == {"markdown", "code"}
  assert any("cli" in cell.source for cell in notebook.cells if cell.cell_type == "code")


def test_a_guide_reads_as_one_markdown_cell():
  text = (DOCS / "training.md").read_text()
  notebook = jupytext_pages.read(text)
  assert [cell.cell_type for cell in notebook.cells] == ["markdown"]
  assert notebook.cells[0].source == text  # Its Python examples stay text, not cells.


def test_the_site_builds_without_a_warning(tmp_path):
  out = tmp_path / "html"
  result = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
       "-d", str(tmp_path / "doctrees"), str(DOCS), str(out)],
      capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  pages = {p.relative_to(DOCS).with_suffix(".html").as_posix()
           for p in [*DOCS.glob("*.md"), *DOCS.glob("notebooks/*.md")]}
  built = {p.relative_to(out).as_posix() for p in out.rglob("*.html")}
  assert pages <= built, pages - built
  index = (out / "index.html").read_text()
  assert 'href="training.html"' in index  # README's docs/ links, relative to the site.
  notebook = (out / "notebooks" / "getting_started.html").read_text()
  assert "cell_input" in notebook  # Rendered as a notebook: its code in cells.
