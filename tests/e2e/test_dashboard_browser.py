"""`/dashboard` in a real headless browser (Debian's `chromium`, tests/browser.py) over a
real `serve run`: two models behind an ingress replica (the two-hop layout, so a model
replica can die while the page stays up). The page renders every node and replica of the
snapshot, its numbers move once load starts, a kill -9 of a replica lands in its fault
timeline, and the playground streams an answer. The screenshot is kept as an artifact:
`.pytest_cache/dashboard.png`. Keys and the JSON: tests/unit/test_cluster_view.py."""

from __future__ import annotations

import os
import signal
from typing import Iterator

import pytest

from tests.browser import browser, chromium
from tests.cluster_view import decoding, snapshot
from tests.e2e.conftest import ROOT
from tests.serve_process import ServeProcess, _descendants, private_serve

pytestmark = pytest.mark.e2e

TINY = {"source": "builtin:tiny", "num_replicas": 1, "max_ongoing_requests": 16}
MODELS = [{"id": "orchard-tiny", **TINY}, {"id": "orchard-tiny-2", **TINY}]
VICTIM = "orchard-tiny-2"
SCREENSHOT = ROOT / ".pytest_cache" / "dashboard.png"

REPLICAS_SHOWN = "[...document.querySelectorAll('.replica')].map(e => e.dataset.replica)"
RATES_SHOWN = "[...document.querySelectorAll('.replica .tps')].map(e => parseFloat(e.textContent))"


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    chromium()  # fail before starting a server the test cannot use
    with private_serve(tmp_path_factory.mktemp("dashboard"), MODELS, ("tiny",),
                       ingress={"colocate": False}) as running:
        yield running


def replica_pid(serve: ServeProcess, model: str) -> int:
    title = f"ray::ServeReplica:orchard:model:{model}".encode()  # Ray's process title
    (pid,) = [pid for pid, cmdline in _descendants(serve.proc.pid) if cmdline.startswith(title)]
    return pid


def test_the_page_shows_the_cluster_live_with_faults_and_a_playground(
        serve: ServeProcess) -> None:
    base = serve.base_url
    with browser() as page:
        page.open(f"{base}/dashboard")
        # Every node and replica of the snapshot, once both models' replicas reported.
        page.wait_for(f"{REPLICAS_SHOWN}.length >= 2")
        snap = snapshot(base)
        shown = set(page.evaluate(REPLICAS_SHOWN))
        assert shown == {r["id"] for n in snap["nodes"] for r in n["replicas"]}
        nodes = page.evaluate("[...document.querySelectorAll('.node')].map(e => e.dataset.node)")
        assert set(nodes) == {n["id"] for n in snap["nodes"]}
        assert page.evaluate("document.querySelectorAll('#models tbody tr').length") == 2

        # Load: the tokens/s on the page move off zero.
        with decoding(base, "orchard-tiny"):
            page.wait_for(f"{RATES_SHOWN}.some(rate => rate > 0)", timeout_s=40)

        # The playground streams an answer from the model picked.
        page.wait_for("document.querySelectorAll('#play-model option').length >= 2")
        page.evaluate("document.getElementById('play-model').value = 'orchard-tiny';"
                      "document.getElementById('play-send').click(); true")
        page.wait_for("document.getElementById('play-output').dataset.done === '1'",
                      timeout_s=60)
        answer = page.evaluate("document.getElementById('play-output').textContent")
        assert answer.strip() and "error" not in page.evaluate(
            "document.getElementById('play-output').className")

        # kill -9 of one model's replica: the timeline shows it lost, then replaced.
        os.kill(replica_pid(serve, VICTIM), signal.SIGKILL)
        faults = "[...document.querySelectorAll('#faults li.fault')].map(e => e.textContent)"
        page.wait_for(f"{faults}.some(f => f.includes('{VICTIM}') && "
                      f"(f.includes('lost') || f.includes('replacement')))", timeout_s=60)
        page.screenshot(SCREENSHOT)

        # Readable in light and dark: the text on the boxes keeps WCAG's AA contrast (4.5).
        contrast = {}
        for scheme in ("light", "dark"):
            page.call("Emulation.setEmulatedMedia", features=[
                {"name": "prefers-color-scheme", "value": scheme}])
            contrast[scheme] = page.evaluate(CONTRAST)
        page.screenshot(SCREENSHOT.with_name("dashboard-dark.png"))
    assert SCREENSHOT.stat().st_size > 10_000
    assert min(contrast.values()) >= 4.5, contrast
    assert contrast["light"] != contrast["dark"]  # the scheme did change the colours


# The contrast ratio of a node box's text on its background (WCAG 2's formula).
CONTRAST = """(() => {
  const rgb = c => c.match(/[0-9.]+/g).slice(0, 3).map(Number);
  const lum = c => { const [r, g, b] = rgb(c).map(v => { v /= 255;
    return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  const style = getComputedStyle(document.querySelector('.node'));
  const [a, b] = [lum(style.color), lum(style.backgroundColor)].sort((x, y) => y - x);
  return Math.round((a + 0.05) / (b + 0.05) * 100) / 100;
})()"""
