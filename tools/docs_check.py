"""Rendering errors in the built docs site that ``mkdocs build --strict`` lets through.

``python -m tools.docs_check SITE_DIR`` (after ``mkdocs build --strict --site-dir SITE_DIR``)
reads every HTML page of the site and fails, listing page and snippet, on:

* **double backticks** left in the text: reStructuredText literals (````x````) that
  Markdown did not turn into code, e.g. one broken across lines of a docstring;
* **broken TeX** in math: a tab or other control character, or the remains of a
  command whose backslash and first letter became a Python escape
  (``"\\top"`` written without ``r`` or a doubled backslash gives a tab and ``op``);
* **raw docstring headers** in the text: ``Args:``, ``Returns:``, ``Raises:``, ...
  at the start of a paragraph, where mkdocstrings did not parse the section (its own
  section titles are ``<span class="doc-section-title">`` and are not flagged).

Code (``<code>``, ``<pre>``), scripts and styles are not checked: backticks and
headers are at home there.
"""

from __future__ import annotations

import argparse
import html.parser
import pathlib
import re
import sys
from collections.abc import Iterator
from typing import NamedTuple

#: Elements whose text is not checked (code shows backticks and headers as written).
SKIPPED = frozenset({"code", "pre", "script", "style", "kbd", "samp"})
#: Elements that end a paragraph-like block: a raw header is one at the start of such a block.
BLOCKS = frozenset(
    {"p", "li", "td", "th", "div", "dd", "dt", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote"}
)
SECTION_HEADERS = (
    "Args",
    "Arguments",
    "Returns",
    "Yields",
    "Raises",
    "Attributes",
    "Example",
    "Examples",
    "Note",
    "Notes",
    "Warning",
    "Warnings",
    "See Also",
    "Other Parameters",
    "Keyword Args",
)
RAW_HEADER = re.compile(rf"^\s*(?:{'|'.join(SECTION_HEADERS)}):(?:\s|$)")
# Python escapes that eat a TeX command's backslash and first letter: \t, \b, \f, \r, \n, \a, \v.
# A control character left in math, or the whitespace an editor made of it followed by the rest of
# a command that starts with the eaten letter (\top -> TAB + "op"), is an error.
_EATEN = (
    "op",
    "imes",
    "ext",
    "heta",
    "ilde",
    "frac",
    "eta",
    "ig",
    "oldsymbol",
    "inom",
    "egin",
    "rac",
    "orall",
    "ight",
    "ho",
    "angle",
    "abla",
    "orm",
    "eq",
    "lpha",
    "pprox",
    "ert",
    "arepsilon",
    "arphi",
)
MATH_CONTROL = re.compile(
    r"[\x00-\x09\x0b\x0c\x0e-\x1f]"
)  # tabs and control characters; newlines are fine
# after a sub/superscript or an opening brace any whitespace, after an operand two or more (a tab an
# editor expanded), then the rest of a command: a_b^<TAB>op g_b
MATH_EATEN = re.compile(
    r"(?:[\^_{(][ \t\x07-\x0d]+|[A-Za-z0-9}][ \t\x07-\x0d]{2,})(?:"
    + "|".join(sorted(_EATEN, key=len, reverse=True))
    + r")\b"
)
MATH_CLASS = "arithmatex"
SECTION_TITLE_CLASS = "doc-section-title"  # mkdocstrings' own section titles ("Returns:")


class Problem(NamedTuple):
    """One rendering error: the page (relative to the site), what is wrong, and where."""

    page: str
    kind: str
    snippet: str

    def __str__(self) -> str:
        return f"{self.page}: {self.kind}: {self.snippet!r}"


class _Texts(html.parser.HTMLParser):
    """Collects a page's checked text: ``(kind, text)`` with kind ``'text'``, ``'math'``,
    ``'block'`` (the text at the start of a block, for raw headers)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, is math, is skipped)
        self.items: list[tuple[str, str]] = []
        self.block_start = True  # the next text opens a block

    def _skipped(self) -> bool:
        return any(tag in SKIPPED or skip for tag, _, skip in self.stack)

    def _math(self) -> bool:
        return any(math for _, math, _ in self.stack)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag in {"br", "img", "hr", "input", "meta", "link", "wbr"}:  # void elements
            return
        self.stack.append((tag, MATH_CLASS in classes, SECTION_TITLE_CLASS in classes))
        if tag in BLOCKS:
            self.block_start = True

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, -1, -1):  # tolerant of unclosed elements
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break
        if tag in BLOCKS:
            self.block_start = True

    def handle_data(self, data: str) -> None:
        if self._skipped():
            if data.strip():
                self.block_start = False
            return
        if self._math():
            self.items.append(("math", data))
        else:
            self.items.append(("text", data))
            if self.block_start and data.strip():
                self.items.append(("block", data))
        if data.strip():
            self.block_start = False


def _snippet(text: str, start: int, end: int, width: int = 40) -> str:
    return " ".join(text[max(0, start - width) : end + width].split())


def check_html(page: str, text: str) -> list[Problem]:
    """The rendering errors of one page's HTML ``text`` (``page`` names it in the report)."""
    parser = _Texts()
    parser.feed(text)
    parser.close()
    found: list[Problem] = []
    for kind, data in parser.items:
        if kind in ("text", "math"):
            for m in re.finditer(r"``", data):
                found.append(
                    Problem(page, f"double backticks in {kind}", _snippet(data, m.start(), m.end()))
                )
        if kind == "math":
            for m in MATH_CONTROL.finditer(data):
                found.append(
                    Problem(
                        page,
                        f"control character {m.group()!r} in math",
                        _snippet(data, m.start(), m.end()),
                    )
                )
            for m in MATH_EATEN.finditer(data):
                found.append(
                    Problem(
                        page,
                        "a TeX command's backslash lost in math (a Python escape?)",
                        _snippet(data, m.start(), m.end()),
                    )
                )
        header = RAW_HEADER.match(data) if kind == "block" else None
        if header:
            found.append(
                Problem(
                    page,
                    "raw docstring header in text",
                    _snippet(data, header.start(), header.end()),
                )
            )
    return found


def check_site(site: pathlib.Path) -> list[Problem]:
    """The rendering errors of every HTML page under ``site``."""
    found = []
    for path in sorted(site.rglob("*.html")):
        found += check_html(path.relative_to(site).as_posix(), path.read_text(encoding="utf-8"))
    return found


def _pages(site: pathlib.Path) -> Iterator[pathlib.Path]:
    yield from site.rglob("*.html")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.docs_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "site", type=pathlib.Path, help="the built site (mkdocs build --site-dir SITE)"
    )
    args = parser.parse_args(argv)
    if not any(_pages(args.site)):
        print(f"docs_check: no HTML page under {args.site}", file=sys.stderr)
        return 2
    problems = check_site(args.site)
    for p in problems:
        print(p)
    pages = len(list(_pages(args.site)))
    print(f"docs_check: {len(problems)} rendering error(s) in {pages} pages", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
