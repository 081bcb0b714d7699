"""The suite's split over xdist workers holds (tests/conftest.py): a package-scoped server
per e2e layout starts once in the whole run, and a module's own fixture once, on a real
`pytest -n 2` of a small copy of the suite's shape. A pytest or xdist upgrade that drops the
groups (pytest 9.2 did, pytest-xdist issue 1386) fails here instead of doubling every
`serve run`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

E2E_CONFTEST = '''
import os, pytest
@pytest.fixture(scope="package", params=["default", "two-hop", "default-haproxy"])
def server(request):
    with open(os.environ["SETUPS"], "a") as log:
        log.write(f"{request.param} {os.environ['PYTEST_XDIST_WORKER']}\\n")
    yield request.param
'''
MODULE_FIXTURE = '''
import os, pytest
@pytest.fixture(scope="module")
def model():
    with open(os.environ["SETUPS"], "a") as log:
        log.write(f"model {os.environ['PYTEST_XDIST_WORKER']}\\n")
'''


def test_each_layout_and_module_fixture_starts_once_over_two_workers(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    tests = tmp_path / "tests"
    (tests / "e2e").mkdir(parents=True)
    (tests / "unit").mkdir()
    (tests / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems\n")
    (tests / "e2e" / "conftest.py").write_text(E2E_CONFTEST)
    for name in ("a", "b", "c"):
        (tests / "e2e" / f"test_{name}.py").write_text(
            "".join(f"def test_{name}{i}(server): pass\n" for i in range(3)))
    (tests / "unit" / "test_m.py").write_text(MODULE_FIXTURE + "".join(
        f"def test_m{i}(model): pass\n" for i in range(6)))
    setups = tmp_path / "setups.log"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadgroup", "--no-loadscope-reorder", "tests"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "SETUPS": str(setups)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "33 passed" in done.stdout, done.stdout[-2000:]
    started = Counter(line.split()[0] for line in setups.read_text().splitlines())
    assert started == {"default": 1, "two-hop": 1, "default-haproxy": 1, "model": 1}, started
    workers = {line.split()[1] for line in setups.read_text().splitlines()}
    assert workers == {"gw0", "gw1"}, workers  # and the work did spread
