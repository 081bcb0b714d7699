"""Guided decoding inside mlx-lm's BatchGenerator, on a real qwen3 with random weights.

The model's logits are wider than the tokenizer (padded ids), and a processor ahead of the
guided one pushes those ids up: unconstrained output picks them, constrained never does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import jsonschema
import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.qwen3 import Model, ModelArgs

from replicas.contract import GuidedSpec
from replicas.pipeline.guided import GuidedLogitsProcessor, GuidedMatcher, compile_guided
from tests.unit.test_guided import build_hf_tokenizer, decode, guided_tokenizer

Processor = Callable[[mx.array, mx.array], mx.array]

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["answer", "n", "ok"],
    "additionalProperties": False,
}
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model() -> Model:
    mx.random.seed(7)
    args = ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        vocab_size=guided_tokenizer().vocab_size, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=True,
    )
    net = Model(args)
    # Default init is so flat that greedy repeats one token; larger weights give varied
    # text, so "same tokens batched as alone" compares something.
    net.update(tree_map(lambda p: 3.0 * p, net.parameters()))
    mx.eval(net.parameters())
    return net


def boost_padded_ids(tokens: mx.array, logits: mx.array) -> mx.array:
    """Make the ids past the tokenizer the model's favourites."""
    boost = mx.arange(logits.shape[-1]) >= len(build_hf_tokenizer())
    return logits + 100.0 * boost


def guided_processor() -> GuidedLogitsProcessor:
    grammar = compile_guided(GuidedSpec("json_schema", json.dumps(SCHEMA)))
    return GuidedLogitsProcessor(GuidedMatcher(guided_tokenizer(), grammar))


def run_batch(model: Model, prompts: Sequence[list[int]],
              processors: Sequence[list[Processor]]) -> list[list[int]]:
    """Greedy tokens per prompt, ending at (and including) a stop id or max tokens."""
    stops = [[t] for t in guided_tokenizer().eos_token_ids]
    gen = BatchGenerator(model, max_tokens=MAX_TOKENS, stop_tokens=stops)
    uids = gen.insert([list(p) for p in prompts], logits_processors=[list(p) for p in processors])
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    finished: set[int] = set()
    while len(finished) < len(uids):
        for response in gen.next()[1]:
            out[response.uid].append(response.token)
            if response.finish_reason is not None:
                finished.add(response.uid)
    gen.close()
    return [out[uid] for uid in uids]


def assert_valid_answer(tokens: list[int]) -> None:
    eos = guided_tokenizer().eos_token_ids
    assert tokens[-1] in eos, "the grammar must end the output with a stop id"
    jsonschema.validate(json.loads(decode(tokens[:-1])), SCHEMA)


def test_mixed_batch_matches_each_request_alone(model: Model) -> None:
    hf = build_hf_tokenizer()
    # Equal lengths, so batching adds no padding that could shift the numerics.
    constrained_prompt = hf.encode("Answer in JSON: is the fox quick?")[:10]
    free_prompt = hf.encode("The quick brown fox jumps over the lazy dog")[:10]

    alone_constrained = run_batch(model, [constrained_prompt],
                                  [[boost_padded_ids, guided_processor()]])[0]
    alone_free = run_batch(model, [free_prompt], [[]])[0]
    mixed = run_batch(model, [constrained_prompt, free_prompt],
                      [[boost_padded_ids, guided_processor()], []])

    assert mixed == [alone_constrained, alone_free]
    assert_valid_answer(alone_constrained)
    assert len(set(alone_free)) > 10, "the unconstrained text should not be one repeated id"
    assert max(alone_constrained) < len(hf), "a padded id got through the mask"
    boosted = run_batch(model, [free_prompt], [[boost_padded_ids]])[0]
    assert min(boosted) >= len(hf), "the boost must bite where nothing masks it"


def test_guided_processor_works_with_generate_step(model: Model) -> None:
    prompt = mx.array(build_hf_tokenizer().encode("Answer in JSON: is the fox quick?"))
    processor = guided_processor()
    tokens: list[int] = []
    for token, _ in generate_step(prompt, model, max_tokens=MAX_TOKENS,
                                  logits_processors=[boost_padded_ids, processor]):
        tokens.append(int(token))
        if tokens[-1] in guided_tokenizer().eos_token_ids:
            break
    assert_valid_answer(tokens)
    assert processor.matcher.is_complete and processor.matcher.error is None
