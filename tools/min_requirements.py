"""Prints the declared minimum versions as pip pins, read from ``pyproject.toml``.

``python -m tools.min_requirements [--extras test,dp]`` (from the repository root)
prints one ``name==floor`` line for each ``name>=floor`` requirement among the core
dependencies and the chosen extras. ``pyproject.toml`` is the one place the floors
are written; ``.ci/min_versions`` passes this output to pip as a constraints file
(``-c``), so the floors are what it installs and tests.

Every core dependency with a floor is pinned (the library runs on them). From the
extras only :data:`EXTRA_FLOORS` are pinned: the libraries that the library or its
tests call into (dp-accounting, flax, equinox). The test tools (pytest, pytest-xdist,
hypothesis, ruff, mypy) stay unpinned: their versions change how the tests are run
or linted, not what the library does, and an old pytest or mypy on a new Python
would test the tools rather than our floors.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tomllib
from collections.abc import Iterable, Sequence
from typing import Any

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"

#: Packages of the extras whose floor is pinned (normalized names).
EXTRA_FLOORS: frozenset[str] = frozenset({"dp-accounting", "flax", "equinox"})

_REQUIREMENT = re.compile(
    r"""^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*
        (?:\[[^\]]*\])?\s*
        (?P<specs>[^;]*?)\s*
        (?:;\s*(?P<marker>.+?))?\s*$""",
    re.VERBOSE,
)
_FLOOR = re.compile(r"^>=\s*(?P<version>[0-9][A-Za-z0-9.+!-]*)$")


def normalize(name: str) -> str:
    """The PEP 503 form of a distribution name (``dp_accounting`` -> ``dp-accounting``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of ``version`` (``0.9.0.1`` -> ``(0, 9, 0, 1)``), for comparing floors."""
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0]))


def parse_floor(requirement: str) -> tuple[str, str | None, str | None]:
    """``(normalized name, floor or None, marker or None)`` of one PEP 508 requirement."""
    match = _REQUIREMENT.match(requirement)
    if match is None:
        raise ValueError(f"cannot read requirement {requirement!r}")
    floor = None
    for spec in filter(None, (s.strip() for s in match["specs"].split(","))):
        found = _FLOOR.match(spec)
        if found is not None:
            floor = found["version"]
    return normalize(match["name"]), floor, match["marker"]


def pins(pyproject: dict[str, Any], extras: Iterable[str] = ()) -> list[str]:
    """The ``name==floor`` pins of the core dependencies and ``extras`` of a parsed pyproject.

    A package required more than once (in several extras) is pinned once, at its
    highest floor. Raises ``KeyError`` for an extra that the pyproject does not define.
    """
    project = pyproject["project"]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    groups: list[tuple[list[str], frozenset[str] | None]] = [
        (project.get("dependencies", []), None)
    ]
    for extra in extras:
        if extra not in optional:
            raise KeyError(f"no extra {extra!r} in pyproject.toml (has: {', '.join(optional)})")
        groups.append((optional[extra], EXTRA_FLOORS))
    chosen: dict[tuple[str, str | None], str] = {}
    for requirements, allowed in groups:
        for requirement in requirements:
            name, floor, marker = parse_floor(requirement)
            if floor is None or (allowed is not None and name not in allowed):
                continue
            previous = chosen.get((name, marker))
            if previous is None or _release(floor) > _release(previous):
                chosen[(name, marker)] = floor
    return [
        f"{name}=={floor}" + (f"; {marker}" if marker else "")
        for (name, marker), floor in chosen.items()
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.min_requirements", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--extras", default="", help="comma-separated extras to include, e.g. test,dp"
    )
    parser.add_argument("--pyproject", type=pathlib.Path, default=PYPROJECT)
    args = parser.parse_args(argv)
    extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    data = tomllib.loads(args.pyproject.read_text(encoding="utf-8"))
    try:
        lines = pins(data, extras)
    except KeyError as err:
        parser.error(str(err.args[0]))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
