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
    # the released package by name; from the repository before the first release (or when
    # asked); from this checkout inside the repository
    assert 'requirement = ["gradclip_jax[dp,demo]"]' in install
    assert 'f"gradclip_jax[dp,demo] @ git+{REPO}"' in install
    assert "FROM_REPOSITORY = False" in install
    assert '"-e", f"{root}[dp,demo]"' in install
    assert "sys.path.insert(0, str(root))" in install
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    assert {"dp", "demo"} <= extras


def install_cell_functions() -> dict:
    """The install cell's helper functions (its code before it acts), defined in a fresh namespace."""
    code = cells(NOTEBOOKS[0], "code")[0]
    ns: dict = {}
    exec(code[: code.index("\nroot = _checkout()")], ns)
    return ns


def test_install_cell_sees_a_clone_folder_as_not_installed(tmp_path, monkeypatch):
    """A clone's folder beside the notebook imports as an empty namespace package: not installed."""
    ns = install_cell_functions()
    (tmp_path / "gcx_clone_probe").mkdir()  # a folder without __init__.py, as a clone's root
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib.util

    assert importlib.util.find_spec("gcx_clone_probe") is not None  # found, as a namespace
    assert not ns["_installed"]("gcx_clone_probe")
    assert not ns["_installed"]("gcx_no_such_module")
    assert ns["_installed"]("json")


def test_install_cell_reports_a_jax_replacement(monkeypatch):
    """The cell warns when pip's plan (its --dry-run report) replaces the installed jax or jaxlib."""
    import importlib.metadata
    import subprocess
    import types

    ns = install_cell_functions()
    have = importlib.metadata.version("jax")
    report = {
        "install": [
            {"metadata": {"name": "jax", "version": "99.0"}},
            {"metadata": {"name": "jaxlib", "version": importlib.metadata.version("jaxlib")}},
            {"metadata": {"name": "gradclip_jax", "version": "0.1.0"}},
        ]
    }
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return types.SimpleNamespace(returncode=0, stdout=json.dumps(report))

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert ns["_jax_changes"](["gradclip_jax[dp,demo]"]) == {"jax": (have, "99.0")}
    assert "--dry-run" in calls[0] and "--report" in calls[0]
    monkeypatch.setattr(
        subprocess, "run", lambda cmd, **kw: types.SimpleNamespace(returncode=1, stdout="")
    )
    assert ns["_jax_changes"](["gradclip_jax[dp,demo]"]) is None  # unresolvable: not on PyPI yet
    code = cells(NOTEBOOKS[0], "code")[0]
    assert "warnings.warn(" in code and "CUDA plugin" in code


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
    assert 'pip install "gradclip_jax[dp,demo]"' in readme  # user install, once released
    assert f'pip install "gradclip_jax[dp,demo] @ git+{URL}"' in readme  # before the first release
    assert 'pip install -e ".[test,dp,demo]"' in readme  # developer install
    assert "python -m gradclip_jax.demo" in readme  # the main job
    for path in NOTEBOOKS:
        assert f"[![Open In Colab]({BADGE_IMAGE})]({colab_link(path.name)})" in readme


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = "python -m pytest -n 2"
    assert command in readme
    # the same tests; CI adds only a report of the slowest ones
    assert re.search(rf"^{re.escape(command)}( --durations=\d+)?$", ci, flags=re.M)
    assert "python -m tools.notebook_figures" in ci


def test_no_other_repository_address():
    """Every link to a gradclip repository (README, docs, notebooks, mkdocs.yml) is the declared one."""
    files = [ROOT / "README.md", ROOT / "mkdocs.yml", *NOTEBOOKS, *(ROOT / "docs").rglob("*.md")]
    pattern = re.compile(
        r"(?:github\.com|colab\.research\.google\.com/github)/([\w.-]+/[\w.-]*gradclip[\w.-]*)",
        re.I,
    )
    owner_repo = URL.removeprefix("https://github.com/")
    found = 0
    for f in files:
        for m in pattern.finditer(f.read_text()):
            found += 1
            assert m.group(1) == owner_repo, f"{f.relative_to(ROOT)}: {m.group(0)}"
    assert found >= 2 * len(NOTEBOOKS)


def test_readme_five_minutes_is_the_dp_guides():
    """The README's DP quick start is the DP guide's, which tests/test_dp_guide.py runs."""

    def five_minutes(text: str) -> str:
        m = re.search(
            r"^## DP-SGD in five minutes\n.*?^```python\n(.*?)^```", text, flags=re.S | re.M
        )
        assert m, "no 'DP-SGD in five minutes' section with code"
        return m.group(1)

    readme = five_minutes((ROOT / "README.md").read_text())
    assert readme == five_minutes((ROOT / "docs" / "guides" / "dp-sgd.md").read_text())
    assert "make_private" in readme and "resume_from" in readme and "epsilon()" in readme


def test_readme_troubleshoots_the_namespace_package():
    readme = (ROOT / "README.md").read_text()
    assert "has no attribute 'clip_by_global_norm'" in readme and "namespace package" in readme
