"""Sphinx configuration for the sparsemap documentation.

Build from the repository root, after an editable install (which builds the
extensions in place)::

    pip install -e ".[docs]"
    python -m sphinx -W -n -b html docs docs/_build/html

``-W -n``: warnings are errors and every cross-reference must resolve (CI builds
it so). The site lands in ``docs/_build/html`` (git-ignored). The API reference
(``docs/api/``: its index from ``__all__`` here, one page per name by
autosummary) and the gallery's figures (``docs/_generated/``) are written at
the start of the build and are git-ignored too. The examples in
the pages are doctests, run by ``tests/test_docs.py``; those in the public
docstrings by ``tests/test_docstrings.py``. ``python docs/check_layout.py
docs/_build/html`` (needs Chromium) lists the code blocks and formulas that a
browser cuts off at the right edge of the built pages.
"""
import importlib
import importlib.util
import inspect
import io
import pkgutil
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# The package is imported from the repository root unless it is installed.
sys.path.insert(0, str(ROOT))

import sparsemap  # noqa: E402
from sphinx.ext.autodoc.mock import mock  # noqa: E402

project = "sparsemap"
author = "the sparsemap developers"
copyright = "2026, the sparsemap developers"
version = sparsemap.__version__
release = sparsemap.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    # MathJax served from the built site instead of a CDN, so formulas render
    # offline; the package ships MathJax 3 and sets mathjax_path.
    "sphinx-mathjax-offline",
    "sphinx.ext.doctest",
    "numpydoc",
    "matplotlib.sphinxext.plot_directive",
]

root_doc = "index"
exclude_patterns = ["_build", "_generated"]
templates_path = ["_templates"]
html_static_path = []
html_theme = "pydata_sphinx_theme"
html_title = "sparsemap"
html_theme_options = {
    "navigation_with_keys": False,
    # four page links and "More" fit the header on one line at 1400 pixels
    "header_links_before_dropdown": 4,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version", "theme-version"],
}
# The left sidebar lists every page (docs/_templates/sidebar-site-nav.html): the
# theme's default lists only the sub-pages of the current top-level page, which
# the narrative pages do not have, so it was empty there.
html_sidebars = {"**": ["sidebar-site-nav"]}
# No external inventories (intersphinx): the build needs no network. So torch's
# classes cannot resolve: SolveInfo's fields are annotated torch.Tensor.
nitpick_ignore = [("py:class", "torch.Tensor")]

# -- autodoc / autosummary -------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_default_options = {"undoc-members": False}
# Cython classes: the class docstring carries the parameters, and its first line
# the constructor's signature (autodoc_docstring_signature reads it).
autoclass_content = "class"
autosummary_generate = True
autosummary_ignore_module_all = False
# Optional dependencies of public modules (sparsemap.torch): when one is not
# installed, autodoc documents the module against a stand-in, so the docs build
# does not need a multi-GB install.
autodoc_mock_imports = [m for m in ("torch",) if importlib.util.find_spec(m) is None]

# -- numpydoc ------------------------------------------------------------------
# The API pages document members with autodoc (templates in _templates/), not
# numpydoc's member tables; parameter types are prose, not cross-references.
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


# -- the API reference, from __all__ --------------------------------------------
def public_modules():
    """``sparsemap`` and each public submodule, with the names each documents.

    A submodule whose names are all re-exported by ``sparsemap`` (the losses)
    gets its module docstring only, linking to the re-exported names; a new
    public module (``sparsemap.torch``, ``sparsemap.plot``, ...) with an
    ``__all__`` appears without any change here.
    """
    top = list(sparsemap.__all__)
    out = [("sparsemap", sparsemap, top, [])]
    for info in sorted(pkgutil.iter_modules(sparsemap.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        name = f"sparsemap.{info.name}"
        with mock(autodoc_mock_imports):
            mod = importlib.import_module(name)
        names = list(getattr(mod, "__all__", []))
        own = [n for n in names if getattr(sparsemap, n, None) is not getattr(mod, n)]
        shared = [n for n in names if n not in own]
        out.append((name, mod, own, shared))
    return out


def _kind(obj):
    if inspect.isclass(obj) and issubclass(obj, sparsemap.Factor):
        return "Factors"
    if inspect.isclass(obj) and issubclass(obj, Warning):
        return "Warnings"
    if inspect.isclass(obj):
        return "Classes"
    if callable(obj):
        return "Functions"
    return "Constants"


_TEMPLATES = {"Factors": "autosummary/factor.rst", "Classes": "autosummary/class.rst",
              "Warnings": "autosummary/class.rst"}


API_INTRO = """\
API reference
=============

Every public name has a page here, generated from its docstring. The package
``sparsemap`` holds the factors, the solver and the losses; each public
submodule follows with the names it adds (its ``__all__``). The narrative pages
(:doc:`../factors`, :doc:`../solvers`, :doc:`../losses`, :doc:`../testing`)
explain how the pieces fit together.
"""


def write_api_reference(app, config):
    """Write docs/api/index.rst: one section per public module, an autosummary per
    kind of name; autosummary then writes a page per name beside it."""
    lines = API_INTRO.splitlines() + [""]
    for name, mod, own, shared in public_modules():
        lines += [f"``{name}``", "-" * (len(name) + 4), "",
                  f".. automodule:: {name}", "", f".. currentmodule:: {name}", ""]
        groups = {}
        for n in own:
            groups.setdefault(_kind(getattr(mod, n)), []).append(n)
        for kind in ("Factors", "Functions", "Classes", "Warnings", "Constants"):
            if kind not in groups:
                continue
            template = _TEMPLATES.get(kind)
            lines += [f".. rubric:: {kind}", "", ".. autosummary::", "   :toctree: .",
                      "   :nosignatures:"]
            lines += [f"   :template: {template}"] if template else []
            lines += [""] + [f"   {n}" for n in groups[kind]] + [""]
        if shared:
            links = ", ".join(f":obj:`sparsemap.{n}`" for n in shared)
            lines += [f"Re-exported by ``sparsemap`` and documented there: {links}.", ""]
    out = HERE / "api" / "index.rst"
    out.parent.mkdir(exist_ok=True)
    text = "\n".join(lines)
    if not out.exists() or out.read_text() != text:   # keep incremental builds incremental
        out.write_text(text)


# -- the gallery's figures -----------------------------------------------------------
def make_gallery_figures(app):
    """Run the Figure 2 script (default settings, the README's command) into
    docs/_generated/, unless its outputs are newer than the script and the package:
    the figure, the table it prints, and the benchmarks page's sentence on it (its
    figures from the same run, so that the prose cannot drift from the table)."""
    out = HERE / "_generated"
    script = ROOT / "benchmarks" / "solver_comparison.py"
    png = out / "solver_comparison.png"
    summary = out / "solver_comparison_summary.inc"
    sources = [script, HERE / "conf.py", *(ROOT / "sparsemap").rglob("*.py"),
               *(ROOT / "sparsemap").rglob("*.pyx")]
    newest = max(s.stat().st_mtime for s in sources)
    if all(p.exists() and p.stat().st_mtime >= newest for p in (png, summary)):
        return
    out.mkdir(exist_ok=True)
    spec = importlib.util.spec_from_file_location("solver_comparison", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stdout = io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(io.StringIO()):
        result = mod.main(["--out", str(out)])
    # the table the script prints, without the closing "wrote ..." line
    table = [ln for ln in stdout.getvalue().splitlines() if not ln.startswith("wrote ")]
    (out / "solver_comparison.txt").write_text("\n".join(table) + "\n")
    summary.write_text(summary_sentence(result["rows"], mod.parse_args([]).max_iter) + "\n")


def summary_sentence(rows, max_iter):
    """The benchmarks page's sentence on the Figure 2 run, from its summary rows."""
    act = next(r for r in rows if r["solver"] == "active_set")
    others = [r for r in rows if r["solver"] != "active_set"]
    n = act["runs"]
    head = (f"In the run above the active set reached a gap of ``1e-8`` on {act['reached']} "
            f"of the {n} instances")
    if act["iterations"] is not None:
        head += (f", in a median of {act['iterations']:.0f} iterations and "
                 f"{1e3 * act['seconds']:.2g} ms (on the machine that built these pages)")
    most = max(r["reached"] for r in others)
    return (f"{head}, with {act['support']:.0f} trees in its final support; no CG variant "
            f"reached it on more than {most} of the {n} instances within {max_iter} iterations, "
            f"and their final supports had {min(r['support'] for r in others):.0f} to "
            f"{max(r['support'] for r in others):.0f} trees.")


def setup(app):
    # before Sphinx lists the documents, and autosummary reads them for names
    app.connect("config-inited", write_api_reference)
    app.connect("builder-inited", make_gallery_figures)
