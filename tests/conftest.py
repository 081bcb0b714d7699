"""How the suite splits over pytest-xdist's workers (`-n 2 --dist loadgroup` in pyproject).

Tests that share one costly fixture (a `serve run`, a Ray cluster, an npm install) form one
group, so the fixture starts once, on one worker. Tests that hold fixed ports share a group
too, so two workers never fight over a port. Everything else is grouped by module (a
module-scoped model loads once). The heaviest groups go first: two workers end together
only if the long ones do not start last.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

# Whole folders that are one group: each shares a package-scoped app or cluster
# (reliability: the private Ray cluster; clients: the npm clients, captures and the trained
# agent model). cluster and sharded each start a two-node `LocalCluster`: one group, so the
# two never start at once (on two cores a joining raylet then misses Ray's fixed 30 s).
FOLDER_GROUPS = {"reliability": "reliability", "clients": "clients",
                 "cluster": "local-cluster", "sharded": "local-cluster"}

# Seconds each heavy group's tests took on the 2-core box in a two-worker run (the junit
# report's times), to start the longest first; groups not named here follow in collection
# order. (test_store_restart.py: 4/6 of the 330 s its six `serve run`s took; it starts four.
# local-cluster: 1185 s in that run, less what tests/sharded's one driver and shorter fault
# streams saved (~40% of its tests' time alone on this box); tenants: 130 s, less ~20 s.)
COST_S = {
    "local-cluster": 950, "reliability": 500, "tests/e2e/test_store_restart.py": 230,
    "tests/e2e/test_disk_cache_restart.py": 170, "e2e-server-default-haproxy": 150,
    "tests/e2e/test_speculative_http.py": 140, "e2e-shared": 140,
    "tests/integration/test_speculative.py": 120, "tests/observability/test_observability_http.py": 110,
    "tests/integration/test_kv_quantized_mla.py": 105, "clients": 105,
    "e2e-server-default": 95, "e2e-server-two-hop": 85, "tests/e2e/test_model_loading_http.py": 80,
    "tests/eval/test_lm_eval.py": 75, "tests/e2e/test_tenants_http.py": 110,
    "tests/e2e/test_dashboard_browser.py": 60,
}


def group_of(item: pytest.Item) -> str:
    path = Path(str(item.path)).resolve().relative_to(item.config.rootpath / "tests")
    folder = path.parts[0]
    fixtures = getattr(item, "fixturenames", ())
    if folder == "e2e" and "server" in fixtures:
        # One group per layout: each layout's `serve run` (package-scoped) starts once, on
        # one worker, and the layouts take ports of their own.
        return f"e2e-server-{item.callspec.params['server']}"  # type: ignore[attr-defined]
    if folder == "e2e" and "shared_app" in fixtures:
        return "e2e-shared"
    return FOLDER_GROUPS.get(folder) or f"tests/{path.as_posix()}"


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    # Marks before every other plugin's hook (xdist reads them in its own); the sort after
    # them all (the folders' own orderings, which a stable sort keeps within each group).
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of(item)))
    yield
    items.sort(key=lambda item: -COST_S.get(group_of(item), 0))
