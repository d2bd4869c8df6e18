"""Sphinx configuration of the jaxinfer docs (Sphinx + MyST, as flax, optax and orbax build theirs).

Build (what tests/test_docs.py runs; any warning fails it):

    python -m sphinx -W -n --keep-going -b html docs docs/_build/html

Offline by design: intersphinx reads the inventories committed in `_inventories/` (written by
`make_jax_inventory.py`), never the network.
"""

import os
import sys

# autodoc imports the jaxinfer of this checkout, not whatever is installed.
sys.path.insert(0, os.path.abspath(".."))

project = "jaxinfer"
author = "the jaxinfer authors"
copyright = "the jaxinfer authors, Apache-2.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_inventories", "Thumbs.db", ".DS_Store"]

# MyST: ::: fences, and anchors for headings so pages can link to each other's sections.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# The docstrings are Google style and write `name` for code, as Markdown does: render single
# backticks in them as literal text (a cross-reference needs an explicit role).
default_role = "literal"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True

# The API pages list what they document explicitly (autosummary tables over autodoc entries on
# the same page), so the build writes nothing into the source tree.
autosummary_generate = False
autodoc_member_order = "bysource"
autodoc_default_options = {"undoc-members": False}
autodoc_typehints = "none"  # types and shapes are given in the docstrings (as flax does)
autodoc_class_signature = "separated"

# Broken cross-references fail the build (sphinx-build -n).
nitpicky = True

intersphinx_mapping = {
    "jax": ("https://docs.jax.dev/en/latest/", "_inventories/jax.inv"),
    "numpy": ("https://numpy.org/doc/stable/", "_inventories/numpy.inv"),
    "python": ("https://docs.python.org/3/", "_inventories/python.inv"),
}

html_theme = "sphinx_book_theme"
html_title = "jaxinfer"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
}
html_last_updated_fmt = None
