"""The release: one version source, a changelog, the release extra and CI script, and a wheel
built by ``python -m build`` that holds every module and data file of the package."""

from __future__ import annotations

import os
import pathlib
import re
import stat
import subprocess
import sys
import zipfile

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

import gradclip_jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gradclip_jax"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION_LINE = re.compile(r'^__version__ = "([^"]+)"$', re.M)


def package_files() -> set[str]:
    """The package's files as a wheel holds them (``gradclip_jax/...``), without caches."""
    return {
        p.relative_to(ROOT).as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in {".pyc", ".pyo"}
    }


def test_version_is_written_once():
    init = (PACKAGE / "__init__.py").read_text()
    (version,) = VERSION_LINE.findall(init)
    assert version == gradclip_jax.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?(?:\.dev\d+)?", version)
    assert "version" in PYPROJECT["project"]["dynamic"] and "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "gradclip_jax.__version__"
    }
    # no other module writes a version of its own
    others = [
        f
        for f in PACKAGE.rglob("*.py")
        if f != PACKAGE / "__init__.py"
        and re.search(r"^\s*(__version__|VERSION|version)\s*=\s*['\"]\d", f.read_text(), re.M)
    ]
    assert not others, others


def test_changelog_has_unreleased_and_the_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "keepachangelog.com" in text
    headings = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert headings[0] == "Unreleased"
    assert gradclip_jax.__version__ in headings
    for heading in headings:
        assert re.search(rf"^\[{re.escape(heading)}\]: https://", text, re.M), heading


def test_release_extra_and_wheel_check_script():
    extras = PYPROJECT["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", r)[0] for r in extras["release"]}
    assert {"build", "twine"} <= names
    script = ROOT / ".ci" / "wheel_check"
    assert script.stat().st_mode & stat.S_IXUSR
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in text
    assert "python -m build" in text and "twine check" in text
    assert re.search(
        r"pip install .*gradclip_jax-\*\.whl|WHEELS=\(\"\$DIST\"/gradclip_jax-\*\.whl\)", text
    )
    assert "pip install --quiet -e" not in text  # the wheel, not the source tree
    assert (
        "pkgutil.walk_packages" in text and "leaves out" in text
    )  # every file and module of the wheel


def test_package_declares_its_typing_marker():
    assert (PACKAGE / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["gradclip_jax"]


@pytest.mark.slow
def test_built_wheel_holds_every_module_and_data_file(tmp_path):
    """``python -m build --wheel`` (isolated, as a release builds it) packs the whole package."""
    pytest.importorskip("build")
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        env=env,
        timeout=600,
    )
    (wheel,) = tmp_path.glob("gradclip_jax-*.whl")
    assert wheel.name.startswith(f"gradclip_jax-{gradclip_jax.__version__}-py3-none-any")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(f"gradclip_jax-{gradclip_jax.__version__}.dist-info/METADATA").decode()
    missing = package_files() - names
    assert not missing, f"not in the wheel: {sorted(missing)}"
    assert f"Version: {gradclip_jax.__version__}" in metadata
    assert "Provides-Extra: release" in metadata and "Provides-Extra: dp" in metadata
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "tools/", "docs/"))]
