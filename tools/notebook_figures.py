"""Executes every notebook and checks that each one shows its figures.

``python -m tools.notebook_figures`` (from the repository root) executes each
notebook in ``notebooks/`` with nbclient, in memory (the files are left as they
are), with the notebook's folder as the kernel's working directory (so the
notebooks' install cell uses this checkout) and without ``MPLBACKEND`` (so
matplotlib picks the inline backend, as in Jupyter and Colab), and counts the
``image/png`` outputs. It fails when a cell
raises, or when a notebook shows fewer figures than :data:`EXPECTED_FIGURES`
lists for it (a notebook that is not listed fails too). nbmake only checks that
the cells run: a notebook whose plots never show (``matplotlib.use("Agg")``
before ``plt.show()``) passes nbmake.

Options: ``--jobs N`` notebooks at once (default 2), ``--save DIR`` keeps the
executed copies (to look at the figures), ``--timeout S`` per cell, and
notebook names to run only those.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"

#: The least number of figures (``image/png`` outputs) each notebook shows.
EXPECTED_FIGURES: dict[str, int] = {
    "quickstart.ipynb": 1,
    "spike_mitigation.ipynb": 1,
    "dp_sgd.ipynb": 1,
    "per_layer_adaptive.ipynb": 1,
}


def count_figures(nb: Any) -> int:
    """The number of ``image/png`` outputs in an executed notebook."""
    return sum(
        1
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if "image/png" in out.get("data", {})
    )


def run_notebook(path: pathlib.Path, timeout: int, save: pathlib.Path | None) -> tuple[int, float]:
    """Executes the notebook at ``path`` in memory and returns ``(figures, seconds)``.

    Raises:
      nbclient.exceptions.CellExecutionError: when a cell raises.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    seconds = time.perf_counter() - t0
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, save / path.name)
    return count_figures(nb), seconds


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.notebook_figures", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("names", nargs="*", help="notebooks to run (default: all in notebooks/)")
    p.add_argument("--jobs", type=int, default=2, help="notebooks executed at once (default 2)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    p.add_argument("--save", type=pathlib.Path, default=None, help="keep the executed copies here")
    a = p.parse_args(argv)

    paths = sorted(NOTEBOOKS.glob("*.ipynb")) if not a.names else [NOTEBOOKS / n for n in a.names]
    missing = [x.name for x in paths if not x.is_file()]
    unlisted = [x.name for x in paths if x.name not in EXPECTED_FIGURES]
    if missing or unlisted:
        print(
            f"error: no such notebook {missing}"
            if missing
            else f"error: {unlisted} not in EXPECTED_FIGURES of {__name__}: say how many figures it shows",
            file=sys.stderr,
        )
        return 2

    def one(path: pathlib.Path) -> tuple[str, str | None, int, float]:
        try:
            n, sec = run_notebook(path, a.timeout, a.save)
        except Exception as err:  # a failing cell: report it, go on with the others
            return path.name, f"{type(err).__name__}: {err}", 0, 0.0
        return path.name, None, n, sec

    os.environ.pop("MPLBACKEND", None)  # the kernels inherit it: leave matplotlib its default
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        results = list(pool.map(one, paths))

    failed = False
    for name, err, n, sec in results:
        want = EXPECTED_FIGURES[name]
        if err is not None:
            failed = True
            print(f"FAIL {name}: a cell raised\n{err}")
        elif n < want:
            failed = True
            print(
                f"FAIL {name}: {n} figure(s), expected at least {want} (is matplotlib.use('Agg') "
                "back, or a plt.show() missing?)"
            )
        else:
            print(f"ok   {name}: {n} figure(s) (at least {want}), {sec:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
