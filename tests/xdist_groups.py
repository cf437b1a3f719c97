"""xdist's ``--dist loadgroup`` on pytest 9: the tests of one ``xdist_group`` on one worker.

pytest-xdist (3.8) sends a group's tests to one worker by the suffix ``@group`` it adds to
their node ids, written to ``item._nodeid``; pytest 9 keeps a node id in ``item._id``, so
the suffix was lost and every group was scattered over the workers: a module-scoped fixture
(the DP guide's run, the LM guide's model) was built once per worker, a cached plan
calibrated once per worker. This plugin (loaded by the root conftest.py) adds the suffix
where xdist's did not take; with a pytest where xdist's does, it does nothing.
"""

from __future__ import annotations

import pytest


def _groups(item: pytest.Item) -> set[str]:
    return {
        str(m.args[0] if m.args else m.kwargs.get("name", "default"))
        for m in item.iter_markers("xdist_group")
    }


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # on an xdist worker under --dist loadgroup only (the controller schedules by these ids)
    if not (hasattr(config, "workerinput") and config.getvalue("loadgroup")):
        return
    for item in items:
        names = _groups(item)
        suffix = "@" + "_".join(sorted(names))
        if names and not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
            from _pytest.nodeid import coerce_node_id  # pytest 9's structured node id

            item._id = coerce_node_id(item.nodeid + suffix)
