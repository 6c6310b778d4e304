"""Every public name has a numpydoc Examples section, and its examples run.

The names are read at collection time from the ``__all__`` of ``sparsemap`` and
of each public submodule (``sparsemap.torch``, ``sparsemap.plot``,
``sparsemap.testing``, ...: every module of the package whose name does not
start with ``_``), so a name or module added later is checked with no change
here. A module that fails to import fails the collection (the ``test`` extra
installs every optional dependency): nothing is skipped.

- Functions and classes: the object's own docstring must have an ``Examples``
  section with at least one ``>>>`` line, and every example in it must print
  what it says (doctest, in a fresh namespace, with the flags of
  ``tests/_doctests.py``). Examples in the docstrings of public methods and
  properties run too.
- Data constants cannot carry a docstring; they must be documented by a ``#:``
  comment on the line above their assignment (what Sphinx shows).

pytest's ``--doctest-modules`` cannot be used instead: it imports modules from
their source files, and the Cython modules have none it can import.
"""
import importlib
import inspect
import pkgutil
import re

import pytest

import sparsemap
from _doctests import API_CODE_WIDTH, METHOD_CODE_WIDTH, run, too_wide


def public_modules():
    names = ["sparsemap"] + sorted(f"sparsemap.{m.name}" for m in pkgutil.iter_modules(sparsemap.__path__)
                                   if not m.name.startswith("_"))
    return [importlib.import_module(n) for n in names]


def public_names():
    """(qualified name, object) for each public name, each object once (re-exports share it)."""
    seen, out = set(), []
    for mod in public_modules():
        assert hasattr(mod, "__all__"), f"{mod.__name__} has no __all__"
        for name in mod.__all__:
            obj = getattr(mod, name)
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            out.append((f"{mod.__name__}.{name}", obj))
    return out


def own_doc(obj):
    """The object's own docstring (a class without one would inherit its base's)."""
    return inspect.cleandoc(obj.__doc__ or "")


def is_documented_object(obj):
    return inspect.isclass(obj) or callable(obj)


NAMES = public_names()
OBJECTS = [(n, o) for n, o in NAMES if is_documented_object(o)]
CONSTANTS = [(n, o) for n, o in NAMES if not is_documented_object(o)]
EXAMPLES = re.compile(r"^Examples\n-{8,}\n(.*?)(?=^\S[^\n]*\n-{3,}\n|\Z)", re.M | re.S)


def member_docs():
    """(qualified name, docstring) of the public methods and properties with examples."""
    out = []
    for qual, obj in OBJECTS:
        if not inspect.isclass(obj):
            continue
        for name, member in vars(obj).items():
            if name.startswith("_"):
                continue
            doc = getattr(member, "__doc__", None)
            if isinstance(doc, str) and ">>>" in doc:
                out.append((f"{qual}.{name}", inspect.cleandoc(doc)))
    return out


MEMBERS = member_docs()


def test_public_names_found():
    found = {n for n, _ in NAMES}
    # one name of each module the issue lists, as a check that the walk works
    assert {"sparsemap.solve", "sparsemap.torch.sparsemap", "sparsemap.plot.heatmap",
            "sparsemap.testing.check_kkt"} <= found
    assert len(OBJECTS) >= 55


@pytest.mark.parametrize("name,obj", OBJECTS, ids=[n for n, _ in OBJECTS])
def test_has_examples_section(name, obj):
    m = EXAMPLES.search(own_doc(obj))
    assert m is not None, f"{name}: no 'Examples' section in its docstring"
    assert ">>>" in m.group(1), f"{name}: its 'Examples' section has no '>>>' example"


@pytest.mark.parametrize("name,obj", OBJECTS, ids=[n for n, _ in OBJECTS])
def test_examples_run(name, obj):
    n, report = run(own_doc(obj), name)
    assert n > 0, f"{name}: no examples to run"
    assert report == "", report


@pytest.mark.parametrize("name,obj", OBJECTS, ids=[n for n, _ in OBJECTS])
def test_code_fits_the_api_page(name, obj):
    """Example and code lines fit the API page (wider ones were cut off at its right edge)."""
    wide = too_wide(own_doc(obj), width=API_CODE_WIDTH)
    assert not wide, "\n".join(wide)


@pytest.mark.parametrize("mod", public_modules(), ids=lambda m: m.__name__)
def test_module_docstring_code_fits(mod):
    """Module docstrings open the API reference's sections."""
    wide = too_wide(inspect.cleandoc(mod.__doc__ or ""), width=API_CODE_WIDTH)
    assert not wide, "\n".join(wide)


# a formula written as code (````argmax_{y in simplex} eta^T A y````) rather than as math
_CODE_FORMULA = re.compile(r"``[^`]*(?:\^|\|\||_\{|argmax|argmin)[^`]*``")


@pytest.mark.parametrize("name,obj", OBJECTS, ids=[n for n, _ in OBJECTS])
def test_summary_line_formulas_are_math(name, obj):
    """The summary line shows in the API tables: formulas there use :math:, not literals."""
    summary = own_doc(obj).split("\n\n")[0]
    assert not _CODE_FORMULA.search(summary), f"{name}: {summary!r}"


@pytest.mark.parametrize("name,doc", MEMBERS, ids=[n for n, _ in MEMBERS])
def test_member_examples_run(name, doc):
    n, report = run(doc, name)
    assert n > 0 and report == "", report


@pytest.mark.parametrize("name,doc", MEMBERS, ids=[n for n, _ in MEMBERS])
def test_member_code_fits(name, doc):
    wide = too_wide(doc, width=METHOD_CODE_WIDTH)
    assert not wide, "\n".join(wide)


@pytest.mark.parametrize("name,obj", CONSTANTS, ids=[n for n, _ in CONSTANTS])
def test_constant_documented(name, obj):
    module, _, attr = name.rpartition(".")
    lines = inspect.getsource(importlib.import_module(module)).splitlines()
    at = [i for i, line in enumerate(lines) if re.match(rf"{re.escape(attr)}\s*(:[^=]*)?=", line)]
    assert at, f"{name}: no assignment found in the module's source"
    assert at[0] > 0 and lines[at[0] - 1].startswith("#:"), \
        f"{name}: expected a '#:' comment on the line above its assignment"


def test_number_flag_tolerates_round_off_only():
    from _doctests import NumberChecker, FLAGS
    c = NumberChecker()
    assert c.check_output("0.333\n", "0.33333333333333337\n", FLAGS)
    assert c.check_output("[1.5e-10 2.0]\n", "[1.5000000001e-10 1.99999999999]\n", FLAGS)
    assert not c.check_output("0.333\n", "0.335\n", FLAGS)
    assert not c.check_output("3\n", "3.0000001\n", FLAGS)      # integers are exact
    assert not c.check_output("0.5 1\n", "0.5\n", FLAGS)
