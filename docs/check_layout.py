"""List what is cut off at the right edge of the built pages, as a browser lays them out.

Usage, after building the site (needs Chromium; on Debian ``apt-get install
chromium``)::

    python -m sphinx -W -n -b html docs /tmp/site
    python docs/check_layout.py /tmp/site [--width 1400] [PAGE.html ...]

Every page (or the ones named, relative to the site) is opened in headless
Chromium at the given window width; a script added to a temporary copy of the
page reports each code block and display formula of the article whose content
is wider than its box (``scrollWidth > clientWidth``): those show a scroll bar
and are cut off at the right edge. One line per such element: the page, its
content and box widths in pixels, and the start of its longest line. The last
line counts them. The check is not part of the test suite (it needs a
browser); ``tests/test_docs.py`` and ``tests/test_docstrings.py`` check the
source's code widths that this layout implies.
"""
import argparse
import html
import pathlib
import re
import subprocess

REPORT = """<script>window.addEventListener('load', function () {
  var out = [];
  var wide = 'article pre, article div.math, article mjx-container[display="true"]';
  document.querySelectorAll(wide).forEach(function (e) {
    if (e.scrollWidth > e.clientWidth + 1) {
      var longest = e.textContent.split('\\n').reduce(function (a, b) {
        return a.length >= b.length ? a : b; });
      out.push(e.scrollWidth + '/' + e.clientWidth + ' ' + longest.slice(0, 100));
    }
  });
  var d = document.createElement('pre');
  d.textContent = 'LAYOUT<<' + out.join('\\n') + '>>LAYOUT';
  document.body.appendChild(d);
});</script></body>"""


def cut_off(site, page, width):
    """The elements of one page wider than their box, as strings."""
    src = site / page
    tmp = src.with_name(src.stem + ".layout-check.html")   # beside it: same relative links
    tmp.write_text(src.read_text().replace("</body>", REPORT, 1))
    try:
        dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                              f"--window-size={width},1000", "--virtual-time-budget=8000",
                              "--dump-dom", tmp.as_uri()],
                             capture_output=True, text=True, timeout=120).stdout
    finally:
        tmp.unlink()
    # the report as the page shows it (escaped), not the script that wrote it
    m = re.search(r"LAYOUT&lt;&lt;(.*?)&gt;&gt;LAYOUT", dom, re.S)
    if m is None:
        return ["no report (the page did not finish loading)"]
    return [html.unescape(line) for line in m.group(1).splitlines() if line.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("site", type=pathlib.Path, help="the built site (sphinx -b html output)")
    ap.add_argument("pages", nargs="*", help="pages relative to the site (default: all)")
    ap.add_argument("--width", type=int, default=1400, help="window width in pixels")
    args = ap.parse_args(argv)
    pages = args.pages or sorted(str(p.relative_to(args.site)) for p in args.site.rglob("*.html")
                                 if "_static" not in p.parts and "_sources" not in p.parts
                                 and not p.name.endswith(".layout-check.html"))
    total = 0
    for page in pages:
        for line in cut_off(args.site, page, args.width):
            print(f"{page}: {line}")
            total += 1
    print(f"cut off: {total}")


if __name__ == "__main__":
    main()
