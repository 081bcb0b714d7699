"""Every `python load/...py` command that load/RESULTS.md and load/README.md cite parses
with that script's own argument parser, so a renamed or removed flag fails the suite
instead of leaving a recorded figure that no longer re-runs."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "load" / "RESULTS.md", ROOT / "load" / "README.md")

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`([^`]+)`")
_SCRIPT = re.compile(r"^load/(\w+)\.py$")


def _commands_in(text: str) -> list[str]:
    """The `python load/...` commands in fenced blocks (continuation lines joined) and in
    inline code spans (which may wrap over a line break)."""
    found: list[str] = []
    for block in _FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            if re.search(r"(^|\s)python load/", line):
                found.append(" ".join(line.split()))
    for span in _INLINE.findall(_FENCE.sub("", text)):
        command = " ".join(span.split())
        if re.search(r"(^|\s)python load/", command):
            found.append(command)
    return found


def _cited() -> list[tuple[str, str]]:
    return [(doc.name, command) for doc in DOCS for command in _commands_in(doc.read_text())]


CITED = _cited()


def test_the_docs_cite_commands() -> None:
    # Guards the extraction itself: an empty list would pass every parametrized case.
    assert {doc for doc, _ in CITED} == {doc.name for doc in DOCS}
    scripts = {word for _, command in CITED for word in command.split() if _SCRIPT.match(word)}
    assert len(scripts) >= 6, scripts


def test_extraction_finds_fenced_wrapped_and_inline_commands() -> None:
    text = ("```bash\npython load/a.py --x 1 \\\n    --y 2\nserve run c.yaml\n```\n"
            "Run `python load/b.py --z\n3` then `load/c.py` (not a command).\n")
    assert _commands_in(text) == ["python load/a.py --x 1 --y 2", "python load/b.py --z 3"]


@pytest.mark.parametrize(("doc", "command"), CITED, ids=[f"{d}: {c}" for d, c in CITED])
def test_cited_command_parses(doc: str, command: str) -> None:
    words = shlex.split(command)
    at = words.index("python")
    script = _SCRIPT.match(words[at + 1])
    assert script, f"{doc}: {command!r} does not name a script in load/"
    assert (ROOT / words[at + 1]).is_file(), f"{doc}: {words[at + 1]} does not exist"
    module = importlib.import_module(f"load.{script.group(1)}")
    build_parser = getattr(module, "build_parser", None)
    assert build_parser is not None, f"load/{script.group(1)}.py has no build_parser()"
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            build_parser().parse_args(words[at + 2:])
    except SystemExit:
        pytest.fail(f"{doc}: {command!r} does not parse today:\n{errors.getvalue()}")
