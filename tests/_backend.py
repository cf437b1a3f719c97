"""What a test needs to know about the backend the suite runs on (see conftest.py).

On a CPU the suite runs as it always has. On another backend conftest.py sets
``jax_default_matmul_precision='float32'`` for the session: a library result and
its reference are then both computed with full float32 products, so the CPU's
float32 tolerances hold there too. The library picks the precision of its own
products (``Precision.HIGHEST``, or ``PRODUCT_PRECISION``) whatever that setting;
what the setting changes is the model's products and the references'.

Three things still depend on the backend:

* whether the library runs ``ghost_sum='backward'``: it refuses it for float32
  models where float32 products default to reduced precision (GPU, TPU; not
  under the suite's full precision). :func:`refuses_backward` asks the library's
  own rule and checks the refusal where it applies;
* what a user's step gets at the backend's default precision
  (:func:`backend_default_precision`);
* a comparison whose reference the backend computes its own way (a float64 GPU
  convolution, a fused multiply-add): :func:`by_backend` names both tolerances.

Tests of XLA:CPU's compiled programs (counts of conditionals, copies, buffer
sizes) are marked ``@pytest.mark.cpu_only(reason=...)`` and skipped elsewhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
import pytest

from gradclip_jax._core.backend import backend_setting
from gradclip_jax.per_example import PRODUCT_PRECISION
from gradclip_jax.per_example._products import DEFAULT_PRODUCT_PRECISION
from gradclip_jax.per_example.ghost._analysis import backward_refusal

T = TypeVar("T")

# The start of the library's message (gradclip_jax/per_example/ghost/_analysis/policy.py, check_sum_precision).
BACKWARD_REFUSAL = r"ghost_sum='backward' cannot be used here: "

# What conftest.py sets PRODUCT_PRECISION to for the session off the CPU: the norms' products
# at HIGHEST on the unrounded operands, as the references are.
SESSION_PRODUCTS = "highest"


def on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def by_backend(cpu: T, other: T) -> T:
    """``cpu`` on a CPU (the tolerance the test always had), ``other`` on any other backend."""
    return cpu if on_cpu() else other


def backend_default_precision() -> Any:
    """A context in which float32 products take the backend's default precision (TF32 on
    NVIDIA GPUs), as in a user's program, instead of the suite's full precision. On a CPU
    the suite runs at that default already."""
    return jax.default_matmul_precision(None)


def library_default_products(setting: str | None = None) -> contextlib.AbstractContextManager[None]:
    """A context in which the library's products take ``setting``, by default the library's own
    default for the backend (``"tf32"`` on GPUs), as in a user's program, instead of the
    suite's session setting; restored afterwards."""
    default = DEFAULT_PRODUCT_PRECISION.get(jax.default_backend(), "highest")
    return backend_setting(PRODUCT_PRECISION, setting or default)


def refuses_backward(
    ghost_sum: str | None, call: Callable[[], Any], *, per_layer: bool = False
) -> bool:
    """Whether the library refuses ``ghost_sum`` for a float32 model on this backend, now.

    The library's own rule decides (``backward_refusal``: the norms' products on TF32-rounded
    operands, ``PRODUCT_PRECISION`` ``"tf32"``, or float32 products at reduced precision by
    default and ``jax_default_matmul_precision`` not ``'float32'``);
    where it refuses, ``call()`` (a trace or a call with that ``ghost_sum``) is checked to
    raise the refusal and ``True`` is returned: the caller has nothing more to compare.
    ``False`` for every other ``ghost_sum``, for per-layer clipping (always book-kept) and
    on a CPU. Models with 16-bit values are refused everywhere; their tests say so.
    """
    if ghost_sum != "backward" or per_layer or backward_refusal() is None:
        return False
    with pytest.raises(ValueError, match=BACKWARD_REFUSAL):
        call()
    return True


def assert_equal_on_cpu(actual: Any, desired: Any, rtol: float = 1e-6, atol: float = 0.0) -> None:
    """Bit-equal on a CPU; within ``rtol``/``atol`` elsewhere, where the same arithmetic may
    round differently: a jitted ``a * b + c`` may be one fused multiply-add (one rounding)
    while run eagerly it rounds twice, and a GPU convolution may take an FFT algorithm."""
    if on_cpu():
        np.testing.assert_array_equal(actual, desired)
    else:
        np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol)
