"""A griffe extension that turns the reST bits of gradclip_jax docstrings into Markdown.

The docstrings are Google style (parsed by mkdocstrings with
``docstring_style: google``) but use a few reST constructs for Sphinx users:
``:func:`x```, ``:class:`x```, ``:mod:`x```, ``:attr:`x``` (rendered here as code
spans), ``:math:`x``` (inline math) and ``.. math::`` blocks (display math, for
``pymdownx.arithmatex``). ``Example:`` sections are renamed ``Examples:`` so
griffe renders their ``>>>`` lines as code.

Loaded from ``mkdocs.yml`` (``extensions: [docs/griffe_rst.py]``); it changes
only what the docs show, never the package.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_ROLE = re.compile(r":(?:func|class|mod|attr|meth|data|obj|exc):`~?([^`]+)`")
_MATH = re.compile(r":math:`([^`]+)`")
_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


def _display_math(text: str) -> str:
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^(\s*)\.\. math::\s*(.*)$", line)
        if not m:
            out.append(line)
            i += 1
            continue
        indent, first = m.group(1), m.group(2)
        body = [first] if first.strip() else []
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)):
            if lines[i].strip():
                body.append(lines[i].strip())
            elif body:  # a blank line ends a block that has started
                break
            i += 1
        if any("&" in b for b in body):
            body = ["\\begin{aligned}", *body, "\\end{aligned}"]
        out.extend(["", f"{indent}$$", *[f"{indent}{b}" for b in body], f"{indent}$$", ""])
    return "\n".join(out)


def rst_to_markdown(text: str) -> str:
    """The docstring ``text`` with its reST roles and math blocks in Markdown."""
    text = _display_math(text)
    text = _MATH.sub(lambda m: f"${m.group(1)}$", text)
    text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    return _EXAMPLE.sub(r"\1Examples:", text)


class RstToMarkdown(Extension):
    """Rewrites every docstring once the object tree is built."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
