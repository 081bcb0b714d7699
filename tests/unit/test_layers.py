"""The layer rules of docs/architecture.md (Layers): import-linter's contracts, plus two
rules checked on grimp's import graph (import-linter's own), which the contracts cannot
state: ingress's allow-list of replica modules, and no import cycle inside a package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ingress", "replicas", "deployments", "load")
# All that ingress may import of the model side: plain data and the errors, no model stack.
INGRESS_MAY_IMPORT = {"replicas.contract", "replicas.errors"}


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    result = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    # Every contract in pyproject.toml was checked and kept.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = len(config["tool"]["importlinter"]["contracts"])
    assert f"Contracts: {contracts} kept, 0 broken" in result.stdout, result.stdout


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line.strip() for line in ci.splitlines() if line.strip().startswith("pip install"))
    assert command in readme, f"README must show the CI test command: {command}"


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    # Every import statement counts: in functions and under `if TYPE_CHECKING:` too, since a
    # deferred import that closes a loop still makes its modules one tangle to read.
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def test_ingress_imports_only_the_replica_contract_and_errors(graph: grimp.ImportGraph) -> None:
    ingress = {"ingress"} | graph.find_descendants("ingress")
    imported = {module for importer in ingress
                for module in graph.find_modules_directly_imported_by(importer)
                if module.split(".")[0] == "replicas"}
    assert imported <= INGRESS_MAY_IMPORT, sorted(imported - INGRESS_MAY_IMPORT)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_a_package(graph: grimp.ImportGraph, package: str) -> None:
    modules = {package} | graph.find_descendants(package)
    edges = {module: (graph.find_modules_directly_imported_by(module) & modules) - {module}
             for module in modules}
    assert _cycles(edges) == []


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import one another, directly or through others."""
    reach = {module: _reachable(edges, module) for module in edges}
    loops = {frozenset(other for other in reach[module] if module in reach[other])
             for module in edges if module in reach[module]}
    return sorted(sorted(loop) for loop in loops)


def _reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(edges[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(edges[module])
    return seen



# One arrow added upward in each direction the engine's layers forbid: KV reaching into the
# batch, sampling into speculation, the pipeline into the KV room.
UPWARD = [("replicas/engine/kv/budget.py", "replicas.engine.batch.local",
           "the engine's rooms are layered"),
          ("replicas/engine/sampling/rejection.py", "replicas.engine.spec.drafter",
           "the engine's rooms are layered"),
          ("replicas/pipeline/output.py", "replicas.engine.kv.prefix_cache",
           "the pipeline imports only the engine's request, delivery and sampling")]


@pytest.mark.parametrize(("importer", "imported", "contract"), UPWARD)
def test_an_upward_arrow_breaks_the_contracts(tmp_path: Path, importer: str, imported: str,
                                              contract: str) -> None:
    # The contracts run on a copy of the sources with one import added, so the test shows
    # they can fail, not only that today's code passes them.
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for package in PACKAGES:
        for source in (ROOT / package).rglob("*.py"):
            target = tmp_path / source.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, target)
    with (tmp_path / importer).open("a") as f:
        f.write(f"\nimport {imported}  # upward\n")
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    result = subprocess.run([exe, "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode != 0
    assert f"{contract} BROKEN" in result.stdout, result.stdout
