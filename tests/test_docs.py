"""The examples in docs/*.rst and in the public docstrings run and print what they say."""
import doctest
import pathlib

import pytest

import sparsemap
import sparsemap.losses
import sparsemap.plot
import sparsemap.testing

DOCS = sorted((pathlib.Path(__file__).parent.parent / "docs").glob("*.rst"))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def public_docstring_examples():
    """Every docstring with examples among the public names, each once."""
    finder = doctest.DocTestFinder()
    modules = (sparsemap.losses, sparsemap.plot, sparsemap.testing)
    found = [t for mod in modules for t in finder.find(mod)]
    found += [t for name in sparsemap.__all__
              for t in finder.find(getattr(sparsemap, name), name=f"sparsemap.{name}")]
    unique = {}
    for t in found:
        if t.examples:
            unique.setdefault(t.docstring, t)   # re-exports share their docstring
    return sorted(unique.values(), key=lambda t: t.name)


EXAMPLES = public_docstring_examples()


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_docs_page_examples(page):
    failed, _ = doctest.testfile(str(page), module_relative=False, optionflags=FLAGS,
                                 verbose=False)
    assert failed == 0


@pytest.mark.parametrize("test", EXAMPLES, ids=[t.name for t in EXAMPLES])
def test_docstring_examples(test):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    runner.run(test)
    assert runner.failures == 0


def test_examples_found():
    assert len(DOCS) >= 5
    assert len(EXAMPLES) >= 5
