"""The notebooks, README and docs point users at one repository address, and the notebooks can show plots.

Fast checks on the files (nothing is executed): the address lives in
``pyproject.toml``'s ``[project.urls]``; every notebook installs from it in its
first code cell and links to Colab with it; no notebook switches matplotlib to a
non-interactive backend; and every notebook has an expected figure count for
``python -m tools.notebook_figures`` (CI), which executes them.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from tools import notebook_figures

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
URL = PYPROJECT["project"]["urls"]["Repository"]
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"


def colab_link(notebook: str) -> str:
    owner_repo = URL.removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{owner_repo}/blob/main/notebooks/{notebook}"


def cells(path: pathlib.Path, kind: str) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


def test_repository_url_is_declared_once():
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", URL), URL
    urls = PYPROJECT["project"]["urls"]
    assert set(urls) >= {"Homepage", "Repository", "Documentation", "Issues"}
    assert all(u == URL or u.startswith(URL + "/") for u in urls.values()), urls


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 4


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_badge(path):
    first = json.loads(path.read_text())["cells"][0]
    assert first["cell_type"] == "markdown"
    badge = f"[![Open In Colab]({BADGE_IMAGE})]({colab_link(path.name)})"
    assert "".join(first["source"]).startswith(badge)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_install_cell(path):
    install = cells(path, "code")[0]
    assert f'REPO = "{URL}"' in install
    # from the repository in a fresh runtime, from this checkout inside the repository
    assert 'f"gradclip_jax[dp,demo] @ git+{REPO}"' in install
    assert '"-e", f"{root}[dp,demo]"' in install
    assert "sys.path.insert(0, str(root))" in install
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    assert {"dp", "demo"} <= extras


def test_notebooks_share_one_install_cell():
    first_cells = {cells(p, "code")[0] for p in NOTEBOOKS}
    assert len(first_cells) == 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_shows_plots(path):
    code = "\n".join(cells(path, "code"))
    assert "matplotlib.use(" not in code  # a non-interactive backend hides every plot
    assert "plt.show()" in code


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")


def test_every_notebook_has_a_figure_count():
    assert set(notebook_figures.EXPECTED_FIGURES) == {p.name for p in NOTEBOOKS}
    assert all(n >= 1 for n in notebook_figures.EXPECTED_FIGURES.values())


def test_readme_install_and_badges():
    readme = (ROOT / "README.md").read_text()
    assert f'pip install "gradclip_jax[dp,demo] @ git+{URL}"' in readme  # user install
    assert 'pip install -e ".[test,dp,demo]"' in readme  # developer install
    assert "python -m gradclip_jax.demo" in readme  # the main job
    for path in NOTEBOOKS:
        assert f"[![Open In Colab]({BADGE_IMAGE})]({colab_link(path.name)})" in readme


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = "python -m pytest -n 2"
    assert command in readme
    assert re.search(rf"^{re.escape(command)}$", ci, flags=re.M)
    assert "python -m tools.notebook_figures" in ci


def test_no_other_repository_address():
    """Every link to a gradclip repository (README, docs, notebooks, mkdocs.yml) is the declared one."""
    files = [ROOT / "README.md", ROOT / "mkdocs.yml", *NOTEBOOKS, *(ROOT / "docs").rglob("*.md")]
    pattern = re.compile(r"(?:github\.com|colab\.research\.google\.com/github)/([\w.-]+/[\w.-]*gradclip[\w.-]*)",
                         re.I)
    owner_repo = URL.removeprefix("https://github.com/")
    found = 0
    for f in files:
        for m in pattern.finditer(f.read_text()):
            found += 1
            assert m.group(1) == owner_repo, f"{f.relative_to(ROOT)}: {m.group(0)}"
    assert found >= 2 * len(NOTEBOOKS)
