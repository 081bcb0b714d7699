"""Embeddings per second: the pooling called in-process vs Orchard's `/v1/embeddings` over
HTTP, same model, one run.

    python -m load.serving.embeddings [--model builtin:embed] [--batch 1 16 64] [--repeat 3]

Raw: the model loaded by the production code (`replicas.sources.load_source`), each request's
texts tokenized by its tokenizer and pooled by `replicas.engine.model.embedding.embed_rows`, the
same code a replica runs, in one forward per request. HTTP: a real `serve run` of that model
alone (the default layout: HTTP served from the model's replica) on 127.0.0.1, one client
sending one request at a time, `--batch` inputs per request, `--encoding` (the `openai`
SDK's default, base64, or float). Each batch size alternates raw and HTTP `--repeat` times
(the server paused during raw runs, so raw never competes with it for the CPU), each run
`--embeddings` vectors; prints embeddings/s as the median with its range, and HTTP/raw as
the median of the pairs' ratios with their range.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import httpx

from load.harness.servers import LAYOUTS, paused, start_server, stop_server
from load.harness.stats import at_least_three, Run, spread

PORT = 8000
MODEL = "bench-embed"
WORDS = ("the river runs past the old mill where children play in summer and the "
         "lighthouse keeper writes letters about storms ships and the quiet sea at night "
         "while the city sleeps under rain").split()


def texts(count: int, rng: random.Random) -> list[str]:
    """Sentences of 12-40 words, each its own: nothing is served from a cache."""
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 40)))
            for _ in range(count)]


class Raw:
    """The pooling called directly on the same model files, as the replica calls it."""

    def __init__(self, source: str) -> None:
        from replicas.embedding_files import EmbeddingSpec, embedding_support
        from replicas.engine.model.embedding import PoolingSpec
        from replicas.sources import load_source

        self.loaded = load_source(source)
        spec = embedding_support(self.loaded.path, None)
        if not isinstance(spec, EmbeddingSpec):
            spec = EmbeddingSpec("last_token", True, False, None)  # a chat model, opted in
        self.spec = PoolingSpec(spec.pooling, spec.normalize)

    def run(self, requests: list[list[str]]) -> Run:
        from replicas.engine.model.embedding import embed_rows

        start = time.perf_counter()
        for batch in requests:
            rows = self.loaded.hf_tokenizer(batch, add_special_tokens=True)["input_ids"]
            embed_rows(self.loaded.model, rows, self.spec)
        return Run(sum(len(b) for b in requests), time.perf_counter() - start)


def http_run(client: httpx.Client, base: str, requests: list[list[str]], encoding: str) -> Run:
    start = time.perf_counter()
    for batch in requests:
        response = client.post(f"{base}/v1/embeddings", json={
            "model": MODEL, "input": batch, "encoding_format": encoding})
        response.raise_for_status()
        assert len(response.json()["data"]) == len(batch)
    return Run(sum(len(b) for b in requests), time.perf_counter() - start)


def embeds(port: int) -> Callable[[], bool]:
    """Whether the server on `port` embeds yet: `serve run`'s readiness check."""
    def ready() -> bool:
        return httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", timeout=60, json={
            "model": MODEL, "input": "hi"}).status_code == 200

    return ready


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="builtin:embed", help="model source")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64],
                        help="inputs per request")
    parser.add_argument("--embeddings", type=int, default=512,
                        help="vectors per run (requests: this over the batch size)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="alternating raw/HTTP runs per batch size (at least 3)")
    parser.add_argument("--encoding", choices=["base64", "float"], default="base64")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="default")
    parser.add_argument("--port", type=int, default=PORT)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    at_least_three(args.repeat, "--repeat")
    rng = random.Random(1234)
    raw = Raw(args.model)
    raw.run([texts(4, rng)])  # warm up: allocator, kernels
    proc = start_server(args.model, MODEL, layout=args.layout, port=args.port,
                        ready=embeds(args.port))
    base = f"http://127.0.0.1:{args.port}"
    results: dict[int, tuple[list[Run], list[Run]]] = {}
    try:
        with httpx.Client(timeout=600) as client:
            http_run(client, base, [texts(4, rng)], args.encoding)  # warm up the path
            for batch in args.batch:
                raws: list[Run] = []
                https: list[Run] = []
                for _ in range(args.repeat):
                    count = max(1, args.embeddings // batch)
                    requests = [texts(batch, rng) for _ in range(count)]
                    with paused(proc.pid):
                        raws.append(raw.run(requests))
                    https.append(http_run(client, base, requests, args.encoding))
                    if proc.poll() is not None:
                        raise RuntimeError("serve run exited during the benchmark")
                results[batch] = (raws, https)
    finally:
        stop_server(proc)

    print(f"model {args.model}, one request at a time, {args.encoding} vectors, layout "
          f"{args.layout}, {args.repeat} alternating raw/HTTP runs of about "
          f"{args.embeddings} embeddings each; medians (min-max)")
    print(f"{'batch':>6}{'raw emb/s':>26}{'HTTP emb/s':>26}{'HTTP/raw':>24}")
    for batch, (raws, https) in results.items():
        ratios = [h.rate / r.rate for r, h in zip(raws, https)]
        print(f"{batch:>6}{spread([r.rate for r in raws]).text():>26}"
              f"{spread([h.rate for h in https]).text():>26}"
              f"{statistics.median(ratios):>10.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
