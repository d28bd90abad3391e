"""Sphinx configuration of ampfunc's documentation site.

Build: ``pip install ".[docs]"`` then ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
Pages are MyST Markdown; the notebooks under ``notebooks/`` are pages too (myst-nb, their stored
outputs shown, nothing executed: ``docs/notebooks`` is a link to that folder, not a copy).
"""

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# The checkout's ampfunc, not an installed one: the reference documents this tree's docstrings.
sys.path.insert(0, str(ROOT))
# Importing ampfunc for autodoc must not compile the kernels.
os.environ.setdefault("AMPFUNC_DISABLE_EXT", "1")

import ampfunc  # noqa: E402

project = "ampfunc"
author = "the ampfunc authors"
copyright = "the ampfunc authors, Apache License 2.0"
release = ampfunc.__version__ if hasattr(ampfunc, "__version__") else "0.1.0"
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints", "README.md"]

# Notebooks: their stored outputs are the page; CI executes them (tests/test_notebooks.py).
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
napoleon_custom_sections = [("Cost", "notes_style")]

# The top-level names are documented twice by design: at the top level (ampfunc.adamw) and in the
# module that defines them (ampfunc.optim.adamw); a type hint naming one of them is then ambiguous.
suppress_warnings = ["ref.python"]

html_theme = "furo"
html_title = f"ampfunc {release}"
templates_path = ["_templates"]
