"""Progress bars of the demo: tqdm when installed, else a plain text bar on stderr."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

__all__ = ["TextBar", "has_tqdm", "progress_bar"]


class TextBar:
    """A minimal progress bar on stderr, for when tqdm is not installed."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n = total, desc, 0
        self._every = max(1, total // 40)

    def update(self, k: int = 1) -> None:
        self.n += k
        if self.n % self._every == 0 or self.n == self.total:
            filled = int(30 * self.n / max(self.total, 1))
            sys.stderr.write(
                f"\r{self.desc:>8} [{'#' * filled}{'.' * (30 - filled)}] {self.n}/{self.total}"
            )
            sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def has_tqdm() -> bool:
    return importlib.util.find_spec("tqdm") is not None


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    if not has_tqdm():
        return TextBar(total, desc)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=True)
