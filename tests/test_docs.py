"""The examples in docs/*.rst and in the public docstrings run and print what they say."""
import doctest
import pathlib
import re

import pytest

import sparsemap
import sparsemap.losses
import sparsemap.lpsmap
import sparsemap.plot
import sparsemap.testing
import sparsemap.torch

DOCS = sorted((pathlib.Path(__file__).parent.parent / "docs").glob("*.rst"))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def public_docstring_examples():
    """Every docstring with examples among the public names, each once."""
    finder = doctest.DocTestFinder()
    modules = (sparsemap.losses, sparsemap.lpsmap, sparsemap.plot, sparsemap.testing,
               sparsemap.torch)
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


def test_readme_python_example_runs():
    """The README's usage block runs as written."""
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})


README_COMMANDS = [
    'pip install -e ".[plot]" && python benchmarks/solver_comparison.py --out figures',
    'pip install -e ".[test]" && python -m pytest',
]


def test_readme_starts_with_the_two_commands():
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    assert readme.splitlines()[:4] == ["```bash", *README_COMMANDS, "```"]


def test_ci_runs_the_readme_test_command_and_the_docs_build():
    root = pathlib.Path(__file__).parent.parent
    ci = (root / ".ci" / "run").read_text().splitlines()
    assert README_COMMANDS[1] in ci
    docs_command = re.search(r"```bash\n(pip install -e \"\.\[docs\]\".*)\n```",
                             (root / "README.md").read_text()).group(1)
    assert docs_command in ci and "-W -n" in docs_command
