"""Every `python -m load...` command that the recorded results (load/results/*.md, indexed
by load/RESULTS.md) and load/README.md cite parses with that module's own argument parser,
so a moved module or a renamed or removed flag fails the suite instead of leaving a
recorded figure that no longer re-runs. A cited `locust -f` file must exist."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "load" / "results").glob("*.md"))
DOCS = (ROOT / "load" / "README.md", *RESULTS)

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`([^`]+)`")
_COMMAND = re.compile(r"(^|\s)(python -m load\.|python load/|locust -f )")
_MODULE = re.compile(r"^load(\.\w+)+$")


def _commands_in(text: str) -> list[str]:
    """The `python -m load...` (and stale `python load/...`) and `locust -f` commands in
    fenced blocks (continuation lines joined) and in inline code spans (which may wrap over
    a line break)."""
    found: list[str] = []
    for block in _FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            if _COMMAND.search(line):
                found.append(" ".join(line.split()))
    for span in _INLINE.findall(_FENCE.sub("", text)):
        command = " ".join(span.split())
        if _COMMAND.search(command):
            found.append(command)
    return found


def _cited() -> list[tuple[str, str]]:
    return [(str(doc.relative_to(ROOT)), command) for doc in DOCS
            for command in _commands_in(doc.read_text())]


CITED = _cited()


def test_the_docs_cite_commands() -> None:
    # Guards the extraction itself: an empty list would pass every parametrized case.
    assert len(RESULTS) >= 5, RESULTS
    assert {doc for doc, _ in CITED} == {str(doc.relative_to(ROOT)) for doc in DOCS}
    modules = {word for _, command in CITED for word in command.split() if _MODULE.match(word)}
    assert len(modules) >= 6, modules


def test_the_index_links_every_results_file() -> None:
    index = (ROOT / "load" / "RESULTS.md").read_text()
    linked = set(re.findall(r"\]\((results/[\w.]+\.md)[#)]", index))
    assert linked == {f"results/{doc.name}" for doc in RESULTS}


def test_extraction_finds_fenced_wrapped_and_inline_commands() -> None:
    text = ("```bash\npython -m load.a --x 1 \\\n    --y 2\nserve run c.yaml\n```\n"
            "Run `python -m load.b --z\n3` then `load.c` (not a command), "
            "`python load/d.py` and `locust -f load/e.py -u 2`.\n")
    assert _commands_in(text) == ["python -m load.a --x 1 --y 2", "python -m load.b --z 3",
                                  "python load/d.py", "locust -f load/e.py -u 2"]


@pytest.mark.parametrize(("doc", "command"), CITED, ids=[f"{d}: {c}" for d, c in CITED])
def test_cited_command_parses(doc: str, command: str) -> None:
    words = shlex.split(command)
    if "locust" in words:
        path = words[words.index("-f") + 1]
        assert (ROOT / path).is_file(), f"{doc}: {command!r}: {path} does not exist"
        return
    at = words.index("python")
    assert words[at + 1] == "-m", f"{doc}: {command!r} runs a file; benchmarks run as modules"
    name = words[at + 2]
    assert _MODULE.match(name), f"{doc}: {command!r} does not name a module in load"
    assert importlib.util.find_spec(name) is not None, f"{doc}: {name} does not exist"
    module = importlib.import_module(name)
    build_parser = getattr(module, "build_parser", None)
    assert build_parser is not None, f"{name} has no build_parser()"
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(words[at + 3:])
    except SystemExit as exit:  # `--help` exits 0; a bad flag exits 2
        if exit.code:
            pytest.fail(f"{doc}: {command!r} does not parse today:\n{errors.getvalue()}")
