"""The examples in docs/*.rst and in the public docstrings run and print what they say."""
import doctest
import pathlib

import pytest

import sparsemap
import sparsemap.losses
import sparsemap.testing

DOCS = sorted((pathlib.Path(__file__).parent.parent / "docs").glob("*.rst"))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_docs_page_examples(page):
    failed, _ = doctest.testfile(str(page), module_relative=False, optionflags=FLAGS,
                                 verbose=False)
    assert failed == 0


@pytest.mark.parametrize("obj", [sparsemap.losses, sparsemap.testing, sparsemap.OracleFactor],
                         ids=lambda m: getattr(m, "__name__", str(m)))
def test_docstring_examples(obj):
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in finder.find(obj):
        runner.run(test)
    assert runner.tries > 0 and runner.failures == 0


def test_docs_exist():
    assert len(DOCS) >= 5
