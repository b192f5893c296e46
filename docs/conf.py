"""The documentation site: Sphinx with MyST-NB over the Markdown pages of docs/.

Build: `sphinx-build -W -b html docs docs/_build/html` (the `docs` extra). The notebooks
render as pages without being run here: `tests/test_notebooks.py` runs each of them, and
running them twice would double their part of CI.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent / "_ext"))

project = "jax-ai-stack"
extensions = ["myst_nb"]
source_suffix = {".md": "myst-nb"}
nb_custom_formats = {".md": "jupytext_pages.read"}
nb_execution_mode = "off"
myst_heading_anchors = 3
exclude_patterns = ["_build", "_ext"]
html_theme = "sphinx_book_theme"
html_title = "jax-ai-stack"
