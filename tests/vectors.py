"""Loading the reference vectors (tests/data/reference_vectors.json).

The file holds the outputs of torchzero 0.4.4, declearn 2.9.1 and PPOxFamily's
``grad_clip_norm_`` on fixed inputs (format: shared spec, reference-semantics §6).
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import numpy as np

DATA = pathlib.Path(__file__).parent / "data" / "reference_vectors.json"


def _num(v: Any) -> Any:
    if isinstance(v, list):
        return [_num(x) for x in v]
    if isinstance(v, str):
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[v]
    return v


def load_cases() -> list[dict]:
    return json.loads(DATA.read_text())["cases"]


def cases_for(*modules: str) -> list[dict]:
    return [c for c in load_cases() if c["module"] in modules]


def arrays(case: dict, key: str, step: int, dtype: Any = np.float64) -> list[np.ndarray]:
    """The tensors of ``case[key][step]`` as numpy arrays with the case's shapes."""
    shapes = case["shapes"]
    return [np.asarray(_num(v), dtype=dtype).reshape(s) for v, s in zip(case[key][step], shapes)]


def param(case: dict, name: str, default: Any = None) -> Any:
    v = case["params"].get(name, default)
    if v == "inf":
        return math.inf
    if v == "-inf":
        return -math.inf
    if isinstance(v, list):
        return tuple(v)
    return v
