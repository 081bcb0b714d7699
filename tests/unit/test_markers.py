"""Every test file in a marked folder carries its folder's marker, so `-m reliability`,
`-m e2e` and `-m "not cluster"` select what the READMEs say. Parsed, not imported: importing
those files would need Ray and the model stack."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# folder -> the marker its test files carry (sharded replicas run on a Ray cluster too;
# observability runs a real `serve run`, as e2e does)
MARKED_FOLDERS = {"e2e": "e2e", "observability": "e2e", "reliability": "reliability",
                  "cluster": "cluster", "sharded": "cluster", "clients": "clients"}


def module_marks(path: Path) -> set[str]:
    """The `pytest.mark.NAME` names of a module-level `pytestmark` (one mark or a list)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    marks: set[str] = set()
    for node in tree.body:
        if not (isinstance(node, (ast.Assign, ast.AnnAssign))):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if not any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            continue
        value = node.value
        items = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
        for item in items:
            if isinstance(item, ast.Call):  # pytest.mark.NAME(...)
                item = item.func
            if (isinstance(item, ast.Attribute) and isinstance(item.value, ast.Attribute)
                    and item.value.attr == "mark"):
                marks.add(item.attr)
    return marks


def test_markers_are_declared(pytestconfig: pytest.Config) -> None:
    declared = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert set(MARKED_FOLDERS.values()) <= declared


@pytest.mark.parametrize("folder", MARKED_FOLDERS)
def test_every_test_file_carries_its_folders_marker(folder: str) -> None:
    files = sorted((ROOT / "tests" / folder).glob("test_*.py"))
    assert files, f"tests/{folder} has no test files"
    mark = MARKED_FOLDERS[folder]
    unmarked = [f.name for f in files if mark not in module_marks(f)]
    assert not unmarked, f"tests/{folder} files without pytestmark = pytest.mark.{mark}: " \
                         f"{unmarked}"


def test_the_parser_sees_marks_and_their_absence(tmp_path: Path) -> None:
    # The check above must be able to fail: a file with no mark, or another mark, has none.
    cases = {
        "pytestmark = pytest.mark.e2e\n": {"e2e"},
        "pytestmark = [pytest.mark.e2e, pytest.mark.timeout(5)]\n": {"e2e", "timeout"},
        "import pytest\n": set(),
        "def test_x():\n    pytestmark = pytest.mark.e2e\n": set(),  # not module level
        "pytestmark = pytest.mark.cluster\n": {"cluster"},
    }
    for source, expected in cases.items():
        path = tmp_path / "test_case.py"
        path.write_text(source)
        assert module_marks(path) == expected, source
