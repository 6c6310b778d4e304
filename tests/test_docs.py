"""The docs pages: their examples run, their code fits the page, and what they cite exists.

The examples in the public docstrings are run by tests/test_docstrings.py.
"""
import pathlib
import re

import pytest

from _doctests import run, too_wide

ROOT = pathlib.Path(__file__).parent.parent
DOCS = sorted((ROOT / "docs").glob("*.rst"))


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_docs_page_examples(page):
    n, report = run(page.read_text(), page.name, str(page))
    assert report == "", report


def test_pages_found():
    assert len(DOCS) >= 5
    assert "lp_sparsemap.rst" in [p.name for p in DOCS]


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_code_fits_the_page(page):
    """Code and doctest lines are at most CODE_WIDTH characters: wider ones were cut
    off at the right edge of the built page (tables of numbers may scroll)."""
    wide = too_wide(page.read_text())
    assert not wide, "\n".join(wide)


def _shipped_text_files():
    """README, docs pages, package sources, examples and benchmarks: what users get."""
    files = [ROOT / "README.md", *DOCS, *(ROOT / "docs" / "_templates").rglob("*.*")]
    for folder in ("sparsemap", "examples", "benchmarks"):
        files += [f for f in (ROOT / folder).rglob("*")
                  if f.suffix in (".py", ".pyx", ".pxd", ".rst", ".md")]
    return files


def test_cited_files_exist():
    """Docs and sources cite only files of the repository (not notes users never get)."""
    missing = []
    for f in _shipped_text_files():
        for name in re.findall(r"[\w./-]+\.md\b", f.read_text()):
            if not any((base / name).exists() for base in (ROOT, f.parent, ROOT / "docs")):
                missing.append(f"{f.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_one_install_story():
    """sparsemap is not on PyPI: every install of it is ``pip install -e`` of the clone,
    never ``pip install sparsemap[...]`` nor a non-editable ``pip install .`` (except
    where a page warns against the latter: "installed with `pip install .`")."""
    bad = []
    pattern = r"(?<!installed with `)(?<!installed with ``)pip install\s+(?!-e\s)[\"']?(?:\.|sparsemap)\b"
    for f in _shipped_text_files():
        for m in re.finditer(pattern, f.read_text()):
            bad.append(f"{f.relative_to(ROOT)}: {m.group(0)}")
    assert not bad, bad


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
