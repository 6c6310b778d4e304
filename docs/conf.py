"""Sphinx configuration for the sparsemap documentation.

Build from the repository root, after building the extensions in place
(``pip install -e .`` or ``python setup.py build_ext --inplace``)::

    pip install ".[docs]"
    python -m sphinx -b html docs /tmp/sparsemap-docs

The output folder is best kept outside the repository. The examples in the
pages are doctests: ``python -m sphinx -b doctest docs /tmp/sparsemap-doctest``
runs them.
"""
import os
import sys

# The package is imported from the repository root unless it is installed.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import sparsemap  # noqa: E402

project = "sparsemap"
author = "the sparsemap developers"
copyright = "2026, the sparsemap developers"
version = sparsemap.__version__
release = sparsemap.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.doctest",
    "numpydoc",
    "matplotlib.sphinxext.plot_directive",
]

root_doc = "index"
exclude_patterns = ["_build"]
templates_path = []
html_static_path = []
html_theme = "alabaster"
html_theme_options = {"description": "Sparse, differentiable structured inference",
                      "page_width": "1100px"}

# -- autodoc -------------------------------------------------------------------
# Members are listed explicitly in the pages; keep the source order.
autodoc_member_order = "bysource"
autodoc_default_options = {"undoc-members": False}
# Cython classes: the class docstring carries the parameters; the pages give
# each constructor's signature explicitly.
autoclass_content = "class"

# -- numpydoc ------------------------------------------------------------------
# No autosummary tables of class members (the pages document the members they
# need with :members:), and no cross-reference guessing for parameter types.
numpydoc_show_class_members = False
numpydoc_show_inherited_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# -- plot directive (docs/plotting.rst) ----------------------------------------
# The figures are drawn at build time from the doctest-format code shown above
# them, so that the code on the page is what made the picture.
plot_include_source = True
plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 110)]
plot_rcparams = {"figure.dpi": 110}

# -- doctest -------------------------------------------------------------------
# Every page imports what its examples use, so that ``python -m doctest
# docs/PAGE.rst`` runs them too.
doctest_global_setup = ""
