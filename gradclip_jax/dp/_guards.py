"""Refuses DP noise inside wrappers that average updates (``optax.MultiSteps``).

``optax.MultiSteps(tx, k)`` hands ``tx`` the **mean** of the last ``k`` updates.
A noising transform inside it adds one noise draw (std :math:`zC`) to the mean
of ``k`` clipped sums: the signal is divided by ``k`` but the noise is not, so
the noise multiplier actually used is :math:`kz` for the signal's scale, and the
update is ``k`` times noisier than the DP-SGD step the accountant describes
for a logical batch of ``k`` pieces. The correct way is to add the ``k``
clipped sums and noise that sum once (``make_private(...,
physical_batch_size=...)``, or its ``clipped_sum`` / ``noisy_update`` pair).

The check runs while the transform is traced (or called eagerly): it looks at
the Python call stack for a ``MultiSteps.update`` frame, so it costs nothing in
a compiled step.
"""

from __future__ import annotations

import sys
from types import FrameType

import optax

__all__ = ["refuse_update_averaging"]


def refuse_update_averaging(fn: str) -> None:
    """Raises ValueError when called (at any depth) from ``optax.MultiSteps.update``."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = (
            frame.f_locals.get("self") if frame.f_code.co_name in ("update", "_do_update") else None
        )
        if isinstance(owner, optax.MultiSteps):
            raise ValueError(
                f"{fn} inside optax.MultiSteps: MultiSteps passes the mean of its k accumulated "
                "updates, so the clipped signal would be divided by k while the noise is not (k times "
                "less signal to noise than the accounted step). Sum the clipped sums of the k pieces "
                "and add noise once per logical step instead: gradclip_jax.make_private(..., "
                "physical_batch_size=...) does it in one call, or use its clipped_sum/noisy_update "
                "pair for host-side accumulation."
            )
        frame = frame.f_back
