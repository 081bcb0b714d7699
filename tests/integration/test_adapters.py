"""LoRA adapters chosen per row (`replicas/engine/model/adapters.py`, `lora.py`): three
adapters (one DoRA, one on a few layers only) and the base, mixed in one batch, each row
greedy-equal token for token to mlx-lm's own generation with that adapter loaded alone
(`mlx_lm.load(path, adapter_path=...)`), on a plain and a 4-bit base model. The adapters
are random-weight, made with mlx-lm's own tuner classes (`replicas.builtin.adapters`)."""

from __future__ import annotations

import asyncio
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

from replicas.builtin.adapters import make_adapter
from replicas.contract import ErrorKind, Failed, Finished, GenerationRequest, OutputEvent, \
    SamplingParams, TokenIds, TokenPrompt
from replicas.engine.batch.local import LocalBatch
from replicas.engine.batch.rows import Done, Row
from replicas.engine.config import EngineConfig, SpeculativeConfig
from replicas.engine.kv.namespace import namespaced
from replicas.engine.model.adapters import AdapterError, load_adapters, read_adapter
from replicas.engine.model.loading import load_model
from replicas.engine.sampling.samplers import make_request_sampler
from replicas.errors import InvalidRequestError
from replicas.replica import ModelReplica, ReplicaOptions
from replicas.sources import resolve_source
from tests.streams import collect

SOURCE = "builtin:tiny"
GREEDY = SamplingParams(temperature=0.0)
NAMES = ("alpha", "beta", "gamma")


def adapter_specs(root: Path) -> dict[str, Path]:
    """alpha: every linear layer; beta: DoRA on attention's q and v; gamma: the last
    layer's MLP only, rank 8."""
    base = resolve_source(SOURCE)
    return {
        "alpha": make_adapter(base, root / "alpha", seed=1),
        "beta": make_adapter(base, root / "beta", seed=2, dora=True,
                             keys=["self_attn.q_proj", "self_attn.v_proj"]),
        "gamma": make_adapter(base, root / "gamma", seed=3, rank=8, num_layers=1,
                              keys=["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]),
    }


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return adapter_specs(tmp_path_factory.mktemp("adapters"))


def quantized(model: nn.Module) -> nn.Module:
    nn.quantize(model, group_size=32, bits=4)
    return model


@lru_cache(maxsize=None)
def reference_model(adapter: str | None, path: str | None, bits: int | None) -> nn.Module:
    model = mlx_load(str(resolve_source(SOURCE)))[0]
    if bits:
        quantized(model)
    if path is not None:  # mlx-lm's own adapter loading, onto the (quantized) base
        from mlx_lm.tuner.utils import load_adapters as mlx_load_adapters
        model = mlx_load_adapters(model, path)
    model.eval()
    return model


def reference(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(token))
    return out


def prompt(i: int) -> list[int]:
    return [(37 * i + 11 * j) % 500 + 3 for j in range(4 + 3 * (i % 5))]


def run_batch(batch: LocalBatch, rows: list[Row], stagger: int = 2) -> dict[int, list[int]]:
    """Rows joining a few at a time (mixed prefill and decode), until every row ends."""
    out: dict[int, list[int]] = {}
    by_uid: dict[int, int] = {}
    pending = list(enumerate(rows))
    live: set[int] = set()
    while pending or live:
        if pending:
            joining, pending = pending[:stagger], pending[stagger:]
            for (i, _), (uid, _) in zip(joining, batch.insert([r for _, r in joining])):
                by_uid[uid] = i
                live.add(uid)
        for response in batch.step():
            out.setdefault(by_uid[response.uid], []).append(response.token)
            if response.finish_reason is not None:
                live.discard(response.uid)
                batch.finish([Done(response.uid, keep=True)])
    return out


@pytest.mark.parametrize("bits", [None, 4])
def test_sixteen_mixed_rows_equal_mlx_lm_alone(adapters: dict[str, Path],
                                               bits: int | None) -> None:
    loaded = load_model(SOURCE, resolve_source(SOURCE))
    model = quantized(loaded.model) if bits else loaded.model
    table = load_adapters(model, {n: str(p) for n, p in adapters.items()})
    # Prefill in chunks of 5 tokens: the prompts (4 to 16 tokens) take up to 4 passes each,
    # beside rows already decoding.
    batch = LocalBatch(model, EngineConfig(prompt_cache_bytes=1 << 24, max_batch_size=16,
                                           prefill_step_size=5), adapters=table)
    choice = [None, *NAMES]
    rows = [Row(tuple(prompt(i)), 0, 6 + i % 5, frozenset(), make_request_sampler(GREEDY),
                adapter=choice[i % 4]) for i in range(16)]
    ours = run_batch(batch, rows)
    for i, row in enumerate(rows):
        name = row.adapter
        ref = reference_model(name, str(adapters[name]) if name else None, bits)
        assert ours[i] == reference(ref, list(row.prompt_ids), row.max_tokens), (i, name)
    # The adapters change the output: each adapter's rows differ from the base's somewhere.
    base = reference_model(None, None, bits)
    for name in NAMES:
        assert any(ours[i] != reference(base, list(r.prompt_ids), r.max_tokens)
                   for i, r in enumerate(rows) if r.adapter == name), name


def test_speculative_rows_keep_their_adapter(adapters: dict[str, Path]) -> None:
    """With prompt-lookup speculation on (and mlx-lm's own join pass, which a speculating
    batch uses), each row's drafts are verified by the model with its adapter: the output
    is still mlx-lm's with that adapter alone."""
    loaded = load_model(SOURCE, resolve_source(SOURCE))
    table = load_adapters(loaded.model, {n: str(p) for n, p in adapters.items()})
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3,
                             prompt_lookup_min=1, disable_when_slower=False)
    batch = LocalBatch(loaded.model, EngineConfig(prompt_cache_bytes=0, speculative=spec),
                       adapters=table)
    choice = [None, *NAMES]
    # Repetitive prompts, so prompt lookup finds drafts.
    rows = [Row(tuple(prompt(i)[:4] * 3), 0, 12, frozenset(), make_request_sampler(GREEDY),
                adapter=choice[i % 4]) for i in range(8)]
    ours = run_batch(batch, rows, stagger=3)
    assert batch.decode_stats.drafted > 0
    for i, row in enumerate(rows):
        name = row.adapter
        ref = reference_model(name, str(adapters[name]) if name else None, None)
        assert ours[i] == reference(ref, list(row.prompt_ids), row.max_tokens), (i, name)


def test_a_prefix_never_crosses_adapters(adapters: dict[str, Path]) -> None:
    loaded = load_model(SOURCE, resolve_source(SOURCE))
    table = load_adapters(loaded.model, {n: str(p) for n, p in adapters.items()})
    batch = LocalBatch(loaded.model, EngineConfig(prompt_cache_bytes=1 << 24), adapters=table)
    shared = prompt(7) * 3
    cache = batch.cache
    assert cache is not None

    def row(adapter: str | None, extra: int) -> Row:
        return Row(tuple(shared + [extra]), 0, 3, frozenset(), make_request_sampler(GREEDY),
                   adapter=adapter)

    first = run_batch(batch, [row("alpha", 5)])
    # Keys live in separate spaces, of the same length.
    longer = shared + [6, 1]
    assert cache.held_length(namespaced(longer, table.namespace("alpha"))) >= len(shared)
    assert cache.held_length(longer) == 0
    assert cache.held_length(namespaced(longer, table.namespace("beta"))) == 0
    # The same prompt under alpha again hits its own KV; under beta or the base, nothing.
    served = {}
    for name in ("alpha", "beta", None):
        (uid, hit), = batch.insert([row(name, 6)])
        served[name] = hit
        while uid in batch._rows:
            for r in batch.step():
                if r.finish_reason is not None:
                    batch.finish([Done(r.uid, keep=False)])
    assert served["alpha"] >= len(shared)
    assert served["beta"] == 0 and served[None] == 0
    # And the hit decodes as alpha alone would.
    ref = reference_model("alpha", str(adapters["alpha"]), None)
    assert first[0] == reference(ref, shared + [5], 3)


def test_a_bad_adapter_is_refused_by_name(adapters: dict[str, Path], tmp_path: Path) -> None:
    loaded = load_model(SOURCE, resolve_source(SOURCE))
    with pytest.raises(AdapterError, match="adapter 'nope'.*does not exist"):
        read_adapter(loaded.model, "nope", tmp_path / "missing")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "adapter_config.json").write_text(
        (adapters["alpha"] / "adapter_config.json").read_text().replace("lora\"", "full\""))
    (wrong / "adapters.safetensors").write_bytes(
        (adapters["alpha"] / "adapters.safetensors").read_bytes())
    with pytest.raises(AdapterError, match="adapter 'wrong': fine_tune_type 'full'"):
        read_adapter(loaded.model, "wrong", wrong)
    narrow = tmp_path / "narrow"  # weights for layers its config does not convert
    narrow.mkdir()
    (narrow / "adapter_config.json").write_text(
        (adapters["gamma"] / "adapter_config.json").read_text())
    (narrow / "adapters.safetensors").write_bytes(
        (adapters["alpha"] / "adapters.safetensors").read_bytes())
    with pytest.raises(AdapterError, match="adapter 'narrow': .* is not an adapter parameter"):
        read_adapter(loaded.model, "narrow", narrow)


def test_an_unknown_adapter_fails_its_row_alone(adapters: dict[str, Path]) -> None:
    loaded = load_model(SOURCE, resolve_source(SOURCE))
    table = load_adapters(loaded.model, {"alpha": str(adapters["alpha"])})
    batch = LocalBatch(loaded.model, EngineConfig(prompt_cache_bytes=0), adapters=table)
    with pytest.raises(KeyError, match="adapter 'nope'"):
        batch.begin(Row((1, 2, 3), 0, 2, frozenset(), make_request_sampler(GREEDY),
                        adapter="nope"))


def test_a_replica_streams_sixteen_mixed_requests(adapters: dict[str, Path]) -> None:
    """Through the replica's production path (config -> load -> prepare -> engine): 16
    concurrent streams over 3 adapters and the base, each equal to mlx-lm alone; an adapter
    the model does not serve is a 400-kind failure of that request alone."""
    options = ReplicaOptions(model_id="tiny", source=SOURCE,
                             adapters=tuple((n, str(p)) for n, p in adapters.items()))
    replica = ModelReplica(options)
    replica.start()
    eos = replica.model.eos_token_ids
    choice = [None, *NAMES]
    try:
        def request(i: int, adapter: str | None) -> GenerationRequest:
            return GenerationRequest(f"r{i}", "tiny", TokenPrompt(tuple(prompt(i))),
                                     SamplingParams(temperature=0.0, max_tokens=8),
                                     report_tokens=True, adapter=adapter)

        async def together() -> list[list[OutputEvent]]:
            return await asyncio.gather(*(collect(replica.stream(request(i, choice[i % 4])))
                                          for i in range(16)))

        results = asyncio.run(together())
        lengths = []
        for i, events in enumerate(results):
            assert isinstance(events[-1], Finished), events[-1]
            ours = [t for e in events if isinstance(e, TokenIds) for t in e.ids]
            name = choice[i % 4]
            ref = reference(reference_model(name, str(adapters[name]) if name else None, None),
                            prompt(i), 8)
            ended = next((n + 1 for n, t in enumerate(ref) if t in eos), len(ref))
            assert ours == ref[:ended][:len(ours)] and len(ours) >= ended - 1, (i, name)
            lengths.append(len(ours))
        assert max(lengths) == 8  # not all cut short by an early EOS
        bad = asyncio.run(collect(replica.stream(request(99, "nope"))))
        assert isinstance(bad[-1], Failed) and bad[-1].kind == ErrorKind.INVALID_REQUEST
        assert "adapter 'nope'" in bad[-1].message
        assert replica.adapter_names() == NAMES
    finally:
        replica.shutdown()


def test_adapters_load_and_unload_under_traffic(adapters: dict[str, Path]) -> None:
    """A replica started with alpha alone: beta is loaded while alpha and base streams
    decode, and its streams then join them; alpha cannot be unloaded while its rows run,
    and once they end it is, and a request for it is refused. Every stream equals mlx-lm
    with its adapter alone, those that overlapped a load included."""
    replica = ModelReplica(ReplicaOptions(model_id="tiny", source=SOURCE,
                                          adapters=(("alpha", str(adapters["alpha"])),)))
    replica.start()
    eos = replica.model.eos_token_ids

    def request(i: int, adapter: str | None, n: int) -> GenerationRequest:
        return GenerationRequest(f"h{i}-{adapter}", "tiny", TokenPrompt(tuple(prompt(i))),
                                 SamplingParams(temperature=0.0, max_tokens=n),
                                 report_tokens=True, adapter=adapter)

    async def scenario() -> tuple[list[list[OutputEvent]], list[str]]:
        notes = []
        first = [asyncio.create_task(collect(replica.stream(request(i, name, 24))))
                 for i, name in enumerate(["alpha", None, "alpha", None])]
        await asyncio.sleep(0.05)
        await replica.load_adapter("beta", str(adapters["beta"]))
        later = [asyncio.create_task(collect(replica.stream(request(i, name, 8))))
                 for i, name in enumerate(["beta", "beta", None], start=4)]
        try:
            await replica.unload_adapter("alpha")
            notes.append("unloaded alpha while in use")
        except InvalidRequestError as exc:
            notes.append(str(exc))
        done = await asyncio.gather(*first, *later)
        await replica.unload_adapter("alpha")
        done.append(await collect(replica.stream(request(9, "alpha", 4))))
        return done, notes

    try:
        results, notes = asyncio.run(scenario())
    finally:
        replica.shutdown()
    assert "in use" in notes[0], notes
    names = ["alpha", None, "alpha", None, "beta", "beta", None]
    for i, (events, name) in enumerate(zip(results, names)):
        assert isinstance(events[-1], Finished), (i, events[-1])
        ours = [t for e in events if isinstance(e, TokenIds) for t in e.ids]
        n = 24 if i < 4 else 8
        ref = reference(reference_model(name, str(adapters[name]) if name else None, None),
                        prompt(i), n)
        ended = next((k + 1 for k, t in enumerate(ref) if t in eos), len(ref))
        assert ours == ref[:ended][:len(ours)] and len(ours) >= ended - 1, (i, name)
    refused = results[-1][-1]
    assert isinstance(refused, Failed) and "adapter 'alpha'" in refused.message
