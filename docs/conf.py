"""Sphinx configuration of hsgd's documentation site.

Build it with ``python -m sphinx -W --keep-going -n -b html docs docs/_build/html``
(what CI runs): every warning, a broken cross-reference (``-n``) or a public
name without a docstring included, fails the build.
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # document this checkout's hsgd, not an installed one
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

try:  # a documentation host may have mpi4py (a dependency) but no MPI library for it to load
    from mpi4py import MPI  # noqa: E402, F401
except (ImportError, RuntimeError):
    # hsgd imports mpi4py.MPI when it is imported. The site documents hsgd and never calls MPI,
    # so stand in Sphinx's mock for that one module, for the whole build (conf.py's import of
    # hsgd, autodoc's and the trainer reference's): the docs then build with the docs extra alone.
    from sphinx.ext.autodoc.mock import MockFinder

    sys.meta_path.insert(0, MockFinder(["mpi4py.MPI"]))

import hsgd  # noqa: E402

project = "hsgd"
author = "the hsgd developers"
copyright = "2026, the hsgd developers"
release = version = hsgd.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "hsgd_docs",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Markdown: GitHub-style anchors for headings (the README and the pages link to sections),
# ``$...$`` left alone, colon fences for directives.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]

# autodoc: the class docstring holds the arguments (Google style, napoleon); signatures carry
# the annotations.
autoclass_content = "class"
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" sections as fields, not as a second description of each property
napoleon_use_ivar = True

# Every cross-reference must resolve (-n). Names of other projects cannot here (the site builds
# offline, without intersphinx), nor hsgd's private modules (hsgd._*), which the site does not
# document: those render as code. A broken reference to anything else fails the build.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|mpi4py|MPI|h5py|argparse|pathlib|contextlib|collections|typing|abc|os|numbers)"
               r"(\..*)?"),
    # type aliases in signatures, shown by name: torch's parameter iterable, numbers, and hsgd's own
    # Literal and container aliases (their values are in the docstrings that use them)
    (r"py:class", r"ParamsT|Number|ReduceOp|NamedTensors|NamedParameterPairs|PhaseCallback|OuterFactory"
                  r"|InterNode|Compression|GraphName|Stall|ModeSettings"),
    (r"py:.*", r"hsgd\._.*"),
    (r"py:.*", r"hsgd(\.[a-z]\w*)*\._\w+(\..*)?"),
]

# "--data" must stay two hyphens in option names, not an en dash
smartquotes = False

html_theme = "furo"
html_title = f"hsgd {release}"
html_static_path: list = []
