"""tools/docs_check.py flags the rendering errors the docs had (on small HTML fixtures) and
passes clean HTML."""

from __future__ import annotations

import pytest

from tools import docs_check


def page(body: str) -> str:
    return f"<html><head><script>var s = '``x``';</script></head><body>{body}</body></html>"


def kinds(body: str) -> list[str]:
    return [p.kind for p in docs_check.check_html("p.html", page(body))]


# the errors the site had, as mkdocs and mkdocstrings render them
BROKEN = {
    # a Returns section whose literal was broken across docstring lines (ClippedGradFn, dp_aggregate)
    "returns_backticks": '<td><div class="doc-md-description"><p>A <code>ClippedGradFn</code>: '
    "``grad_fn(params, batch, *args, mask=None) -&gt;</p></div></td>",
    # "\top" in a Python string: a tab, then "op" (docs/guides/ghost-clipping.md)
    "tab_in_math": '<p>adds <span class="arithmatex">\\(c_b a_b^\top g_b\\)</span> to float32</p>',
    # the same with the tab expanded to spaces by an editor
    "expanded_tab_in_math": '<p>adds <span class="arithmatex">\\(c_b a_b^    op g_b\\)</span></p>',
    # an RST literal inside TeX's \text
    "backticks_in_math": '<div class="arithmatex">\\[\\text{(the last ``history_size`` norms)}\\]</div>',
    # a section mkdocstrings did not parse (bad indentation): its header left in the text
    "raw_returns": "<p>Returns:\n  the clipped updates.</p>",
    "raw_args": "<li>Args: x: the input.</li>",
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_flags_each_rendering_error(name):
    found = docs_check.check_html("api/x/index.html", page(BROKEN[name]))
    assert found, name
    assert all(p.page == "api/x/index.html" and p.snippet for p in found)


def test_names_what_is_wrong():
    assert kinds(BROKEN["returns_backticks"]) == ["double backticks in text"]
    assert "control character '\\t' in math" in kinds(BROKEN["tab_in_math"])
    assert kinds(BROKEN["expanded_tab_in_math"]) == [
        "a TeX command's backslash lost in math (a Python escape?)"
    ]
    assert set(kinds(BROKEN["backticks_in_math"])) == {"double backticks in math"}  # both pairs
    assert kinds(BROKEN["raw_returns"]) == ["raw docstring header in text"]


CLEAN = [
    '<p><span class="doc-section-title">Returns:</span></p><table><tr><td>x</td></tr></table>',
    "<p>A <code>ClippedGradFn</code>, called as <code>grad_fn(params, batch)</code></p>",
    "<pre><code>def f(x):\n    ``x``\n    Args:\n      x: a value\n</code></pre>",
    '<p><span class="arithmatex">\\(c_b a_b^\\top g_b\\)</span> and '
    '<span class="arithmatex">\\(\\text{max\\_norm} \\cdot \\text{mul} \\cdot m\\)</span></p>',
    '<div class="arithmatex">\\[\n\\begin{aligned}\nu &amp;\\leftarrow u\n\\end{aligned}\n\\]</div>',
    "<p>The function returns: a tree. Args are positional.</p>",
    "<p>Returns the clipped updates (a sentence, not a header).</p>",
]


@pytest.mark.parametrize("body", CLEAN)
def test_passes_clean_html(body):
    assert docs_check.check_html("p.html", page(body)) == []


def test_main_lists_page_and_snippet_and_fails(tmp_path, capsys):
    (tmp_path / "api").mkdir()
    (tmp_path / "index.html").write_text(page(CLEAN[0]))
    (tmp_path / "api" / "dp.html").write_text(page(BROKEN["returns_backticks"]))
    assert docs_check.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "api/dp.html: double backticks in text: " in out and "grad_fn(params" in out
    (tmp_path / "api" / "dp.html").write_text(page(CLEAN[1]))
    assert docs_check.main([str(tmp_path)]) == 0


def test_main_refuses_a_folder_without_pages(tmp_path):
    assert docs_check.main([str(tmp_path)]) == 2
