"""Contract tests for the private parts of mlx-lm, mlx-vlm and Ray Serve that Orchard
relies on (`replicas.versions` names them): each fails when a hook no longer exists or no
longer behaves as the code that uses it assumes, so moving a pin shows what broke."""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache


@pytest.fixture(scope="module")
def model() -> llama.Model:
    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2,
                           intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=64, num_key_value_heads=2)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


def test_the_batch_generator_steps_the_batches_put_in_its_private_fields(
        model: llama.Model) -> None:
    # `replicas.engine.batch.local` puts our decoding and prefilling batches in these two
    # fields after construction; mlx-lm must read them there and step the decoding one's
    # `_step` (our `Generation` overrides it).
    calls: list[str] = []

    class Decoding(GenerationBatch):
        def _step(self) -> Any:
            calls.append("step")
            return super()._step()

    class Prefill(PromptProcessingBatch):
        def generate(self, tokens: list[list[int]]) -> GenerationBatch:
            calls.append("generate")
            return super().generate(tokens)

    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    assert isinstance(gen._generation_batch, GenerationBatch)
    assert isinstance(gen._prompt_batch, PromptProcessingBatch)
    gen._generation_batch = Decoding.empty(model, gen.sampler)
    gen._prompt_batch = Prefill.empty(model, gen.sampler)
    gen.insert([[1, 2, 3], [4, 5]], max_tokens=[3, 3])
    tokens = 0
    for _ in range(20):
        tokens += len(gen.next_generated())
        if tokens >= 6:
            break
    assert tokens == 6
    assert "generate" in calls and calls.count("step") >= 2
    assert isinstance(gen._generation_batch, Decoding)  # extended in place, never replaced
    # `Prefilling._copy` calls mlx-lm's `_copy` for `split`.
    assert callable(getattr(PromptProcessingBatch, "_copy", None))


def test_the_batch_cache_keeps_its_write_index_in_idx() -> None:
    # `spec.tails` and `kv.quantized` read and set `_idx`, and rely on left padding: a row's
    # offset is its length, the index is the longest row's, padded rows start later.
    cache = BatchKVCache([1, 0])
    k = mx.zeros((2, 2, 3, 4))
    cache.update_and_fetch(k, k)
    assert cache._idx == 3
    cache.update_and_fetch(k[:, :, :1], k[:, :, :1])
    assert cache._idx == 4
    assert cache.offset.tolist() == [3, 4]
    assert cache.left_padding.tolist() == [1, 0]
    assert cache.trim(2) == 2 and cache._idx == 2


def test_the_absorbed_attention_classes_are_where_mla_expects_them() -> None:
    from replicas.engine.model import mla

    table = next(v for k, v in vars(mla).items()
                 if isinstance(v, dict) and v and all(isinstance(c, type) for c in v))
    assert len(table) >= 9
    for original in table:
        assert callable(original.__call__), original  # its instances are re-classed in place


def test_serve_router_internals_the_prefix_router_uses() -> None:
    from ray.serve.request_router import RequestRouter

    assert callable(RequestRouter._remove_pending_request_from_indices)
    params = list(inspect.signature(RequestRouter._probe_queue_lens).parameters)
    assert params == ["self", "replicas", "backoff_index"]
    # An instance attribute: set in the constructor, read with `.get(replica_id)`.
    assert "self._replica_queue_len_cache" in inspect.getsource(RequestRouter.__init__)


def test_serve_replica_http_server_takes_what_the_port_patch_forwards() -> None:
    from ray.serve._private import replica

    params = inspect.signature(replica.start_asgi_http_server).parameters
    names = list(params)
    assert names[:2] == ["app", "http_options"]
    assert params["event_loop"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["enable_so_reuseport"].kind is inspect.Parameter.KEYWORD_ONLY


def test_mlx_vlm_loads_and_exposes_its_language_model_as_vision_rewires_it() -> None:
    from mlx_vlm.models import mistral3
    from mlx_vlm.utils import load_model, load_processor

    assert callable(load_model) and callable(load_processor)
    # `replicas.vision` swaps the language model's `embed_tokens` for the served model's.
    assert "self.language_model" in inspect.getsource(mistral3.Model.__init__)


def test_attention_layers_call_mlx_lm_s_function_through_their_module(model: llama.Model) -> None:
    # `replicas.engine.kv.attention.install` routes paged attention by replacing the
    # `scaled_dot_product_attention` a model's module imported from `mlx_lm.models.base`,
    # and calls it with the cache and the mask as keywords.
    from mlx_lm.models import base

    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
    params = list(inspect.signature(base.scaled_dot_product_attention).parameters)
    assert params[:6] == ["queries", "keys", "values", "cache", "scale", "mask"]
    seen: list[Any] = []
    original = llama.scaled_dot_product_attention
    try:
        def spy(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                scale: float, mask: Any, **kw: Any) -> mx.array:
            seen.append(cache)
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

        llama.scaled_dot_product_attention = spy  # type: ignore[assignment]
        model(mx.array([[1, 2, 3]]))
    finally:
        llama.scaled_dot_product_attention = original  # type: ignore[assignment]
    assert len(seen) == len(model.layers)  # each layer's attention came through it
