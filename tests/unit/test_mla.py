"""MLA's short passes in the latent space (`replicas.engine.mla`): a pass of a few positions
over a cached context gives what mlx-lm's decompressing route gives, and every model the
production loader returns takes it; long passes (prefill) keep mlx-lm's route."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.deepseek_v3 import DeepseekV3Attention

from replicas.engine.loading import load_model
from replicas.engine.mla import SHORT_PASS, ShortPassMLA
from replicas.sources import resolve_source


def attentions(model: object) -> list[object]:
    return [m for _, m in model.named_modules()  # type: ignore[attr-defined]
            if isinstance(m, DeepseekV3Attention)]


@pytest.mark.parametrize("width", [2, 5, SHORT_PASS])
def test_a_short_pass_gives_what_mlx_lms_route_gives(width: int) -> None:
    model = load_model("builtin:arch-mla", resolve_source("builtin:arch-mla")).model
    assert attentions(model) and all(type(a) is ShortPassMLA for a in attentions(model))
    context = mx.array([[3 + i % 90 for i in range(40)]])
    step = mx.array([[7 + i for i in range(width)]])

    def run() -> mx.array:
        cache = make_prompt_cache(model)
        model(context, cache=cache)
        return model(step, cache=cache)

    absorbed = run()
    for attention in attentions(model):
        attention.__class__ = DeepseekV3Attention
    try:
        decompressed = run()
    finally:
        for attention in attentions(model):
            attention.__class__ = ShortPassMLA
    assert mx.allclose(absorbed, decompressed, atol=1e-4, rtol=1e-4)
    assert mx.argmax(absorbed, -1).tolist() == mx.argmax(decompressed, -1).tolist()
