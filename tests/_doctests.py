"""Running doctests the same way for the docs pages and the public docstrings.

``run(text, name)`` parses ``>>>`` examples out of a docstring or an .rst page
and runs them in a fresh ``__main__`` namespace (every example imports what it
uses, so it can be pasted as is) with the option flags below, and returns the
number of examples and the failure report (empty when every example printed
what it says).

``NUMBER`` (the flag pytest's doctest plugin also registers): a number written
with a decimal point or an exponent in the expected output matches any number
within one unit of its last written digit, so ``0.333`` matches
``0.33333333333333337``; write the digits that matter. Integers and all other
text must match as usual (with ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``).
Figures drawn by examples are closed after each run (the Agg backend is set by
``conftest.py``).
"""
import doctest
import io
import re

NUMBER = doctest.register_optionflag("NUMBER")
FLAGS = NUMBER | doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# a number, not part of a word or of a longer number
_NUM = re.compile(r"(?<![\w.])[+-]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?(?![\w.])")


def _tolerance(text):
    """One unit of the last digit written in ``text``, or None for an integer."""
    mantissa, _, exponent = text.lower().partition("e")
    if "." not in mantissa and not exponent:
        return None
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


class NumberChecker(doctest.OutputChecker):
    """doctest's checker, plus the ``NUMBER`` flag described above."""

    def check_output(self, want, got, optionflags):
        if super().check_output(want, got, optionflags):
            return True
        if not optionflags & NUMBER:
            return False
        wanted, found = list(_NUM.finditer(want)), list(_NUM.finditer(got))
        if len(wanted) != len(found):
            return False
        pieces, end = [], 0
        for w, g in zip(wanted, found):
            tol = _tolerance(w.group())
            close = tol is not None and abs(float(w.group()) - float(g.group())) <= tol * (1 + 1e-9)
            pieces += [got[end:g.start()], w.group() if close else g.group()]
            end = g.end()
        return super().check_output(want, "".join(pieces) + got[end:], optionflags)


def run(text, name, filename=None, lineno=0):
    """Run the examples in ``text``; returns (number of examples, failure report)."""
    test = doctest.DocTestParser().get_doctest(text, {"__name__": "__main__"}, name,
                                               filename or name, lineno)
    out = io.StringIO()
    runner = doctest.DocTestRunner(checker=NumberChecker(), optionflags=FLAGS)
    try:
        runner.run(test, out=out.write, clear_globs=True)
    finally:
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            pass
        else:
            plt.close("all")
    return len(test.examples), out.getvalue()


# -- what the pages show as code, for the width check --------------------------------

# Code wider than this is cut off at the right edge of the built pages' content
# column. Measured in headless Chromium at a 1400-pixel-wide window, a character
# of code is 8.84 pixels wide; a narrative page's code box is 701 pixels wide (80
# characters took 707), an API page's 669 (76 took 673) and a method's on an API
# page 637 (73 took 647).
CODE_WIDTH = 79
API_CODE_WIDTH = 75
METHOD_CODE_WIDTH = 71

_BLOCK = re.compile(r"^(\s*)(?:\.\. (?:code-block|code|sourcecode)::\s*(\w*)|(?!\.\.).*::)\s*$")


def code_lines(text):
    """(line number, kind, line) of what ``text`` (rst) shows as code.

    Doctest examples (``>>> ``/``... `` prompts included) with their expected
    output, and the lines of code blocks and literal blocks (without the
    block's indentation); ``kind`` is the block's language (``"doctest"`` for
    examples, ``"literal"`` for ``::`` blocks).
    """
    out = []
    for ex in doctest.DocTestParser().parse(text):
        if isinstance(ex, doctest.Example):
            src = ex.source.rstrip("\n").split("\n")
            shown = [">>> " + src[0]] + ["... " + s for s in src[1:]]
            shown += ex.want.rstrip("\n").split("\n") if ex.want else []
            out += [(ex.lineno + 1 + k, "doctest", s) for k, s in enumerate(shown)]
    lines = text.split("\n")
    n = 0
    while n < len(lines):
        m = _BLOCK.match(lines[n])
        n += 1
        if not m:
            continue
        kind = m.group(2) if m.group(2) is not None else "literal"
        outer = len(m.group(1))
        while n < len(lines) and (not lines[n].strip() or lines[n].lstrip().startswith(":")):
            n += 1                                    # blank lines and the directive's options
        if n == len(lines):
            break
        inner = len(lines[n]) - len(lines[n].lstrip())
        if inner <= outer:
            continue
        while n < len(lines) and (not lines[n].strip()
                                  or len(lines[n]) - len(lines[n].lstrip()) >= inner):
            if lines[n].strip() and not lines[n].lstrip().startswith(">>>"):
                out.append((n + 1, kind or "default", lines[n][inner:]))
            n += 1
    return out


def too_wide(text, exempt=("text",), width=CODE_WIDTH):
    """Code lines of ``text`` wider than ``width``, as 'line N: ...' strings.

    Blocks in ``exempt`` languages (tables of numbers) may scroll sideways:
    wrapping would break their columns.
    """
    return [f"line {n} ({len(s)} characters): {s}" for n, kind, s in code_lines(text)
            if len(s.rstrip()) > width and kind not in exempt]
