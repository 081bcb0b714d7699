"""A process that ran a replica exits cleanly: ten times in a row, a script starts a real
replica (`builtin:tiny`, the production loading code), serves one request, shuts the
replica down while a second row is still decoding, and exits with code 0.

Before the engine's thread stayed pooled (`replicas.engine.mlx_thread`), about one exit in
four aborted with "terminate called without an active exception" (exit 134): MLX's
per-thread compile cache was destroyed after `join` returned, racing the interpreter's
finalization."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import asyncio
    from replicas.contract import GenerationRequest, SamplingParams, TextPrompt
    from replicas.replica import ModelReplica, ReplicaOptions

    replica = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny"))
    replica.start()

    async def main() -> None:
        done = GenerationRequest(request_id="done", model="tiny", prompt=TextPrompt("Hello"),
                                 sampling=SamplingParams(temperature=0.0, max_tokens=8))
        assert [e async for e in replica.stream(done)]
        long = GenerationRequest(request_id="long", model="tiny",
                                 prompt=TextPrompt("Hello " * 200),
                                 sampling=SamplingParams(temperature=0.0, max_tokens=4000))
        seen = 0
        async for _ in replica.stream(long):
            seen += 1
            if seen > 3:
                break  # the row is still decoding when the replica shuts down
    asyncio.run(main())
    replica.shutdown()
    print("served")
""")


def test_ten_clean_exits_in_a_row() -> None:
    for run in range(10):
        result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, (run, result.returncode, result.stderr[-3000:])
        assert "served" in result.stdout
        assert "terminate called" not in result.stderr
