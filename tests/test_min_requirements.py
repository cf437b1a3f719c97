"""tools/min_requirements.py: pyproject.toml's floors as pip pins (used by .ci/min_versions)."""

from __future__ import annotations

import pathlib
import tomllib

import pytest

from tools import min_requirements as mr

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))

SYNTHETIC = """
[project]
name = "demo"
dependencies = [
    "jax>=0.9.2",
    "Jax_Lib >= 0.9.2, <1",
    "numpy~=2.0",
    "scipy",
    "tomli>=2.0; python_version < '3.11'",
]

[project.optional-dependencies]
test = ["pytest>=8", "flax[all]>=0.12.2", "equinox>=0.12.2,!=0.13.0"]
dp = ["dp_accounting>=0.5.1"]
demo = ["dp-accounting>=0.6", "matplotlib>=3.7"]
"""


def floors_in_pyproject(group: list[str]) -> dict[str, str]:
    return {name: floor for name, floor, _ in map(mr.parse_floor, group) if floor is not None}


def test_real_pyproject_pins_every_core_floor_and_the_extras_libraries():
    core = floors_in_pyproject(PYPROJECT["project"]["dependencies"])
    extras = PYPROJECT["project"]["optional-dependencies"]
    pins = mr.pins(PYPROJECT, ["test", "dp"])
    assert pins == [f"{n}=={v}" for n, v in core.items()] + [
        f"{n}=={floors_in_pyproject(extras[e])[n]}"
        for e, n in [("test", "flax"), ("test", "equinox"), ("dp", "dp-accounting")]
    ]
    names = [p.split("==")[0] for p in pins]
    assert set(names) == {
        "jax",
        "jaxlib",
        "optax",
        "chex",
        "numpy",
        "flax",
        "equinox",
        "dp-accounting",
    }
    assert len(names) == len(set(names))
    versions = dict(p.split("==") for p in pins)
    assert versions["jax"] == versions["jaxlib"]  # installed as a pair
    # the core alone: no extras' packages; test tools are never pinned
    assert mr.pins(PYPROJECT) == pins[: len(core)]
    assert not {"pytest", "pytest-xdist", "hypothesis", "ruff", "mypy"} & set(names)


def test_cli_prints_the_pins(capsys):
    assert mr.main(["--extras", "test, dp"]) == 0
    assert capsys.readouterr().out.splitlines() == mr.pins(PYPROJECT, ["test", "dp"])


def test_synthetic_pyproject(tmp_path, capsys):
    data = tomllib.loads(SYNTHETIC)
    # names normalized; only `>=` floors; markers kept for pip's constraints file
    assert mr.pins(data) == ["jax==0.9.2", "jax-lib==0.9.2", "tomli==2.0; python_version < '3.11'"]
    # from the extras only the libraries in EXTRA_FLOORS; extras ([all]) and other specifiers dropped
    assert mr.pins(data, ["test", "dp"])[3:] == [
        "flax==0.12.2",
        "equinox==0.12.2",
        "dp-accounting==0.5.1",
    ]
    # a package in several extras is pinned once, at its highest floor
    assert mr.pins(data, ["dp", "demo"])[3:] == ["dp-accounting==0.6"]
    assert mr.pins(data, ["demo", "dp"])[3:] == ["dp-accounting==0.6"]
    with pytest.raises(KeyError, match="no extra 'nope'"):
        mr.pins(data, ["nope"])

    path = tmp_path / "pyproject.toml"
    path.write_text(SYNTHETIC, encoding="utf-8")
    assert mr.main(["--pyproject", str(path), "--extras", "dp"]) == 0
    assert capsys.readouterr().out.split("\n")[-2] == "dp-accounting==0.5.1"
    with pytest.raises(SystemExit):
        mr.main(["--pyproject", str(path), "--extras", "nope"])


@pytest.mark.parametrize(
    ("requirement", "expected"),
    [
        ("numpy>=2.0", ("numpy", "2.0", None)),
        (
            "Dp.Accounting >= 0.5.1 ; python_version >= '3.11'",
            ("dp-accounting", "0.5.1", "python_version >= '3.11'"),
        ),
        ("mkdocstrings[python]>=0.26", ("mkdocstrings", "0.26", None)),
        ("jupyter", ("jupyter", None, None)),
        ("jax>0.9,<1", ("jax", None, None)),
    ],
)
def test_parse_floor(requirement, expected):
    assert mr.parse_floor(requirement) == expected
