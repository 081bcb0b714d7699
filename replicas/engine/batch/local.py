"""The batch a replica decodes: mlx-lm's `BatchGenerator` with the KV prefix cache beside it.
(What the engine drives of it is `batch/protocol.py`'s `Batch`; paging its KV, `paging.py`.)

Everything that changes the batch goes through here as a few whole operations (insert rows,
step, finish rows, recover after a failed step), never as loose calls on the generator. That is what lets a
sharded replica run the same batch on every rank: `replicas.engine.sharded.lockstep` records these
operations on rank 0 and replays them on the others, and the engine above never knows how
many ranks there are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, StopSequences

from replicas.engine.config import EngineConfig
from replicas.engine.kv.disk import DiskTier, Snapshot, snapshot
from replicas.engine.batch.decode import Generation
from replicas.engine.sampling.logprobs import Picked
from replicas.engine.kv.quantized import cache_maker
from replicas.engine.kv.blocks import BlockPool
from replicas.engine.kv.budget import KvBudget
from replicas.engine.kv.paged import as_paged_rows, make_paged_prompt_cache
from replicas.engine.kv.prefix_cache import CacheHit, PromptCache, prefix_view, segments
from replicas.engine.kv.directory import HeldBlocks
from replicas.engine.kv.namespace import namespaced
from replicas.engine.model.adapters import AdapterFiles, AdapterTable
from replicas.engine.model.mrope import row_positions
from replicas.engine.batch.image_prefix import Prefill, prefill_chunk
from replicas.engine.batch.paging import PrefixShares, hit_blocks, make_pool, unpaged
from replicas.engine.batch.protocol import Batch as Batch  # its home before the split
from replicas.engine.batch.rows import Done, Exported, Row
from replicas.engine.batch.prefill import Prefilling
from replicas.engine.request import PromptEmbeddings
from replicas.engine.batch.scoring import score_prompt
from replicas.engine.spec.sharded import SharedDrafts
from replicas.engine.sampling.samplers import LogitsProcessor, Sampler
from replicas.engine.model.mtp import Mtp
from replicas.engine.spec.factory import make_drafter, usable
from replicas.engine.spec.gate import SpeculationGate
from replicas.engine.spec.drafter import DecodeStats
from replicas.engine.stats import DecodeCounts

log = logging.getLogger(__name__)


class LocalBatch:
    """The batch of one process. Not thread-safe: the engine thread alone calls it."""

    def __init__(self, model: nn.Module, config: EngineConfig, cache_cost_scale: tuple[int, int]
                 = (1, 1), disk: DiskTier | None = None, held: HeldBlocks | None = None,
                 shared_drafts: Callable[[mx.Stream], SharedDrafts] | None = None,
                 draft: nn.Module | Mtp | None = None, gate: SpeculationGate | None = None,
                 adapters: AdapterTable | None = None) -> None:
        """`shared_drafts`: on a sharded replica, how this rank shares speculation's
        decisions with the others, over the batch's stream. `draft`: the draft model
        speculation drafts with (`speculative.draft_model`), or the model's MTP layer.
        `gate`: what an earlier batch measured of drafting's pace (a benchmark's rounds
        share one); by default a new one where `speculative.disable_when_slower`.
        `adapters`: the model's LoRA adapters, which rows pick by name (`Row.adapter`);
        by default none, until `load_adapter`."""
        self.adapters = adapters if adapters is not None else AdapterTable(model)
        self._draft = draft
        self._model = model
        self._positions = row_positions(model)  # M-RoPE rows' deltas; None: 1-D positions
        self._config = config
        self._cache = PromptCache(config.prompt_cache_bytes, cost_scale=cache_cost_scale,
                                  disk=disk, held=held) if config.prompt_cache_bytes > 0 else None
        # The batch's work, in order: one stream only (`replicas.engine.batch.prefill` says why).
        self.stream = mx.new_stream(mx.default_device())
        self.decode_stats = DecodeStats()  # kept across `recover`
        # Every row's fresh cache: a quantized row could not share a batch with mlx-lm's.
        self._make_cache = cache_maker(config.kv_bits, config.kv_group_size)
        self._pool: BlockPool | None = None  # paged KV's blocks (`page`), else None
        self._shares: PrefixShares | None = None  # paged with a prefix cache: hits' blocks
        self._speculative = usable(config.speculative, model)
        self._shared = shared_drafts(self.stream) if shared_drafts and self._speculative \
            else None
        spec = self._speculative
        self.gate = (gate or SpeculationGate()) if spec and spec.disable_when_slower else None
        self._gen = self._new_generator()
        # Rows mlx-lm ended in the last step, with their KV (it drops them from the batch).
        self._ended: dict[int, tuple[list[int], list[Any]]] = {}
        self._rows: set[int] = set()  # uids in the batch
        # Rows whose prompt starts with embeddings: the prefix cache's key for that start.
        self._keys: dict[int, tuple[int, ...]] = {}
        # Rows with a LoRA adapter: their key space in the prefix cache (`kv/namespace.py`).
        self._spaces: dict[int, int] = {}
        # Rows `begin` or `advance` readied (by id), waiting for `insert`: their prefix KV
        # and the prompt tokens the prefix cache served.
        self._prepared: dict[int, tuple[CacheHit, int]] = {}

    @property
    def empty(self) -> bool:
        """No rows: the engine will not step again until something is inserted."""
        return not self._rows

    @property
    def cache(self) -> PromptCache | None:
        return self._cache

    def _new_generator(self) -> BatchGenerator:
        gen = BatchGenerator(
            self._model,
            completion_batch_size=self._config.max_batch_size,
            prefill_batch_size=self._config.prefill_batch_size,
            prefill_step_size=self._config.prefill_step_size,
            stream=self.stream,
        )
        # Our decoding batch in place of mlx-lm's (`replicas.engine.batch.decode`): mlx-lm
        # 0.32.2 only ever `extend`s and `filter`s this attribute after building it.
        drafter = make_drafter(self._speculative, self._draft, self._config.prefill_step_size)
        decoding = Generation.make(self._model, gen.sampler, drafter, self._shared, self.gate)
        decoding.stats = self.decode_stats
        decoding.slots = self.adapters.slots
        decoding.positions = self._positions
        gen._generation_batch = decoding
        # And our prefilling batch (`replicas.engine.batch.prefill`): mlx-lm `extend`s it.
        prefilling = Prefilling.empty(self._model, gen.sampler,
                                      prefill_step_size=self._config.prefill_step_size)
        prefilling.in_pass = drafter is None
        prefilling.slots = decoding.slots
        prefilling.positions = self._positions
        gen._prompt_batch = prefilling
        self._decoding = decoding
        return gen

    def decode_counts(self) -> DecodeCounts:
        d, spec = self.decode_stats, self._speculative
        return DecodeCounts(spec is not None, d.passes, d.tokens, d.drafted, d.accepted,
                            d.forced, d.rows_off_path, spec.method if spec else "")

    def insert(self, rows: Sequence[Row]) -> list[tuple[int, int]]:
        """Add rows; each reuses the KV of its longest cached prompt prefix. Returns each
        row's (uid, prompt tokens served from the cache)."""
        prepared = [self._prepared.pop(id(r), None) for r in rows]
        slots = [self.slot(r.adapter) for r in rows]  # an adapter unknown here fails them all
        hits = [p[0] if p else self._cache.fetch(self.row_key(r)) if self._cache else None
                for r, p in zip(rows, prepared)]
        served = [p[1] if p else h.length if h else 0 for p, h in zip(prepared, hits)]
        uids = self._gen.insert_segments(
            [segments(list(r.prompt_ids), h.length if h else 0, r.boundary)
             for r, h in zip(rows, hits)],
            caches=[self._paged(h.cache) if h else self._make_cache(self._model)
                    for h in hits],
            # The tokens the cache holds: penalties and the batch's bookkeeping see them.
            all_tokens=[list(r.prompt_ids[:h.length]) if h else [] for r, h in zip(rows, hits)],
            max_tokens=[r.max_tokens for r in rows],
            samplers=[r.sampler for r in rows],
            # Rows without processors skip mlx-lm's per-row path entirely.
            logits_processors=[list(r.processors) for r in rows],
            stop_sequences=[StopSequences([[t] for t in sorted(r.stop_ids)]) for r in rows],
        )
        self._rows.update(uids)
        if self._shares is not None:  # what each row shares, for admission (`KvBudget`)
            self._shares.by_uid.update((uid, hit_blocks(h.cache, h.length) if h else
                                        frozenset()) for uid, h in zip(uids, hits))
        self._keys.update((uid, r.embeddings.key) for uid, r in zip(uids, rows)
                          if r.embeddings is not None)
        if self._positions is not None:  # rows after an image: M-RoPE's shift
            self._positions.by_uid.update((uid, r.embeddings.rope_delta)
                                          for uid, r in zip(uids, rows)
                                          if r.embeddings is not None and r.embeddings.rope_delta)
        for uid, r, slot in zip(uids, rows, slots):
            if slot:
                self.adapters.slots.by_uid[uid] = slot
                self._spaces[uid] = self.adapters.namespace(r.adapter)
        return list(zip(uids, served))

    def slot(self, adapter: str | None) -> int:
        """An adapter's slot (0: None, the base); a KeyError for one not loaded."""
        return self.adapters.slot(adapter)

    def row_key(self, row: Row) -> list[int]:
        """The row's prompt as the prefix cache keys it: images by content, in its
        adapter's key space."""
        return namespaced(row.key, self.adapters.namespace(row.adapter))

    def cache_ids(self, tokens: Sequence[int], adapter: str | None) -> list[int]:
        """Prompt ids as the prefix cache, its disk tier, the directory and pulls key them."""
        return namespaced(tokens, self.adapters.namespace(adapter))

    def load_adapter(self, adapter: AdapterFiles) -> None:
        """Serve `adapter` from the next step on (read and checked off the engine thread:
        `read_adapter`); replacing one that rows use now is refused."""
        if adapter.name in self.adapters.names and self.adapters.rows_using(adapter.name):
            raise ValueError(f"adapter '{adapter.name}' is in use by "
                             f"{self.adapters.rows_using(adapter.name)} rows: unload it first")
        self.adapters.load([adapter])

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (a KeyError if not loaded); refused while rows use
        it. Its prefix cache entries age out (no new row keys into its space)."""
        if self.adapters.rows_using(name):
            raise ValueError(f"adapter '{name}' is in use by "
                             f"{self.adapters.rows_using(name)} rows: try again when they end")
        self.adapters.unload(name)

    def _paged(self, cache: list[Any]) -> list[Any]:
        """A prefix hit as rows the batch merges: paged rows where the batch pages."""
        return cache if self._pool is None else as_paged_rows(cache, self._pool)

    def page(self, kv: KvBudget, context_length: int) -> None:
        """Page the batch's KV where `paged_kv` asks and the model qualifies: a block pool
        sized from `kv`'s budget, and `kv` admitting by blocks, a prefix hit's shared
        blocks counted once (`batch/paging.py`). `paged_kv: on` where the model does not
        qualify refuses to load, saying why."""
        mode = self._config.paged_kv
        if mode == "off":
            return
        why = unpaged(self._config, self._speculative is not None or self._draft is not None,
                      self._model)
        if why is not None:
            if mode == "on":
                raise ValueError(f"memory.paged_kv is on, but {why}")
            log.info("paged KV (auto): the padded batch, since %s", why)
            return
        self._pool, plan = make_pool(self._config, kv, context_length)
        if self._cache is not None:
            self._cache.attach(self._pool)
            self._shares = PrefixShares(self._cache, self.cache_ids)
        self._make_cache = partial(make_paged_prompt_cache, pool=self._pool)
        kv.paging, kv.blocks, kv.shares = plan, self._pool.stats, self._shares

    def begin(self, row: Row) -> Prefill | None:
        """Before `insert`: a row whose prompt starts with embeddings takes that prefix's KV
        from the prefix cache, or gets a `Prefill` to `advance` until done (None: nothing
        to prefill). A failure on the way fails its request alone, never the batch."""
        self.slot(row.adapter)  # an adapter not loaded fails its request here, alone
        if row.embeddings is None:
            return None
        if row.adapter is not None:
            raise ValueError("a prompt with images cannot use a LoRA adapter yet")
        hit = self._cache.fetch(row.key) if self._cache else None
        if hit is not None and hit.length >= len(row.embeddings.key):
            self._prepared[id(row)] = (hit, hit.length)
            return None
        return Prefill(row, self._make_cache(self._model))

    def advance(self, prefill: Prefill) -> bool:
        """One prefill-sized chunk of `prefill` (the vision tower with the first); True when
        the prefix is done and kept in the prefix cache under its content key."""
        if not prefill_chunk(self._model, prefill, self._config.prefill_step_size,
                             self.stream, self._positions):
            return False
        row = prefill.row
        assert row.embeddings is not None
        key = row.embeddings.key
        cache = prefill.cache
        if self._cache is not None:
            self._cache.save(list(key), cache)
            cache = prefix_view(cache, 0)  # the batch owns a view; the entry stays whole
        self._prepared[id(row)] = (CacheHit(cache, len(key)), 0)
        return True

    def step(self) -> list[Any]:
        """One batch step (prefill and/or decode): mlx-lm's responses, one per row that got
        a token. Rows mlx-lm ended itself (stop id, length) have left the batch.

        mlx-lm's `next` decodes, then prefills; here the prefill goes first, so the rows it
        readies join this very pass (their prompt's last token rides in it: `prefilling`)
        and get their first token no later than after mlx-lm's pass of their own. The
        pass is queued last: it computes while the engine turns its tokens into events."""
        self._decoding.held = True
        try:  # mlx-lm's `next` with its decode held back: joins and prefill only
            prefilled, _ = self._gen.next()
        finally:
            self._decoding.held = False
        if self._cache is not None:  # before this step's decode is queued
            self._cache.save_boundaries(self._gen, prefilled, self._key)
        with mx.stream(self.stream):
            responses: list[Any] = self._decoding.next()  # mlx-lm's Response, loosely typed
        self._ended = {r.uid: (self._key(r.uid, r.all_tokens), r.prompt_cache)
                       for r in responses
                       if r.finish_reason is not None and r.prompt_cache is not None}
        for r in responses:  # the batch holds an ended row's KV (`_ended`) until `finish`,
            r.prompt_cache = None  # and only the batch: its blocks go back there, not later
        self._forget(r.uid for r in responses if r.finish_reason is not None)
        return list(responses)

    def finish(self, done: Sequence[Done]) -> None:
        """Take rows out of the batch (those still in it) and keep the KV of normal ends."""
        batched = [d.uid for d in done if d.uid not in self._ended]
        if self._cache is not None:
            keep = [d.uid for d in done if d.keep]
            self._save([self._ended[u] for u in keep if u in self._ended],
                       [u for u in keep if u not in self._ended])
        if batched:
            self._gen.remove(batched)
        for d in done:  # an ended row's KV (paged: its blocks) goes back now, not next step
            self._ended.pop(d.uid, None)
        self._forget(d.uid for d in done)
        if self._pool is not None and not self._rows:
            # The batch is empty: the pool's trailing free capacity goes back now, not at a
            # write that an idle replica may not see for hours.
            self._pool.trim()

    def _key(self, uid: int, tokens: Sequence[int]) -> list[int]:
        """Row `uid`'s tokens as the prefix cache keys them (its images by content)."""
        start = self._keys.get(uid, ())
        return namespaced([*start, *tokens[len(start):]], self._spaces.get(uid, 0))

    def _forget(self, uids: Iterable[int]) -> None:
        for uid in list(uids):
            self._rows.discard(uid)
            self._keys.pop(uid, None)
            if self._positions is not None:
                self._positions.by_uid.pop(uid, None)
            if self._spaces.pop(uid, None) is not None:
                self.adapters.slots.by_uid.pop(uid, None)
            if self._shares is not None:
                self._shares.by_uid.pop(uid, None)

    def _save(self, ended: list[tuple[list[int], list[Any]]], batched: list[int]) -> None:
        assert self._cache is not None
        try:  # a failure costs reuse only: the cache is an optimisation
            if batched:
                ended += [(self._key(uid, t), c)
                          for uid, (c, t) in self._gen.extract_cache(batched).items()]
            for tokens, cache in ended:
                self._cache.save(list(tokens), cache)
        except Exception:  # noqa: BLE001
            log.exception("saving a prompt cache entry failed")

    def score(self, prompt_ids: Sequence[int], top: int,
              adapter: str | None = None) -> list[Picked]:
        """The prompt's token logprobs from one prefill (`replicas.engine.batch.scoring`); its KV
        goes into the prefix cache, for the generation that follows."""
        with self.adapters.slots.rows([self.slot(adapter)]):
            picked, cache = score_prompt(self._model, prompt_ids, top,
                                         self._config.prefill_step_size, self.stream,
                                         self._make_cache)
        if self._cache is not None:
            self._cache.save(self.cache_ids(prompt_ids, adapter), cache)
        return picked

    def recover(self) -> bool:
        """After a failed step: a fresh, empty batch (the cache keeps what it holds)."""
        self._gen = self._new_generator()
        self._ended = {}
        self._rows = set()
        self._keys = {}
        self._spaces = {}
        if self._shares is not None:
            self._shares.by_uid.clear()
        self.adapters.slots.by_uid.clear()
        if self._positions is not None:
            self._positions.by_uid.clear()
        return True

    def held_length(self, tokens: Sequence[int]) -> int:
        """Prompt tokens the prefix cache could serve now (all of them without a cache:
        nothing is worth pulling into a replica that keeps nothing)."""
        return self._cache.held_length(list(tokens)) if self._cache else len(tokens)

    def export_prefix(self, tokens: Sequence[int], at_least: int) -> Exported | None:
        """The longest cached prefix of `tokens` (memory or disk), snapshot for another
        replica; None under `at_least` tokens."""
        hit = self._cache.fetch(list(tokens), count=False) if self._cache else None
        if hit is None or hit.length < at_least:
            return None
        return Exported(tuple(tokens[:hit.length]), snapshot(hit.cache))

    def adopt(self, tokens: Sequence[int], layers: list[Any], staged: str = "") -> None:
        """Keep a pulled prefix for the request about to start (`PromptCache.adopt`).
        `staged`: on a sharded replica, the id of the other ranks' parts."""
        if self._cache is not None:
            self._cache.adopt(list(tokens), layers)

    def bound_cache(self, nbytes: int) -> None:
        """The prefix cache holds at most `nbytes` from now on (`PromptCache.bound`: what
        KV memory admission leaves it)."""
        if self._cache is not None:
            self._cache.bound(nbytes)

    def close(self) -> None:
        """The prefix cache to its disk tier, if any (a lockstep batch also tells the other
        ranks)."""
        if self._cache is not None:
            self._cache.close()
