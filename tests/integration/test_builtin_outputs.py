"""builtin:tiny, loaded by the production loader, reproduces every script exactly:
through mlx_lm's own generate functions and through continuous batching, with prompts
rendered by the production path (a GenerationRequest, its tools included, through
`replicas.pipeline.prompt.render_prompt`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import BatchGenerator, generate_step, stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from transformers import AutoTokenizer

from replicas.builtin import ensure_builtin, load_scripts, script
from replicas.builtin.scripts import Script
from replicas.contract import (
    GenerationRequest,
    SamplingParams,
)
from replicas.pipeline.prompt import render_prompt
from tests.scripted import script_request

SCRIPT_IDS = [s.id for s in load_scripts()]
MAX_TOKENS = 300  # well past the longest script, so a missing eos would show


@pytest.fixture(scope="module")
def loaded() -> tuple[Any, Any]:
    return mlx_lm.load(str(ensure_builtin("tiny")))


def request_for(s: Script) -> GenerationRequest:
    """The request the ingress adapters build for a script: its tools included."""
    return script_request(s, sampling=SamplingParams(temperature=0.0))


def production_prompt(tokenizer: Any, s: Script) -> list[int]:
    """How the replica renders a request (replica.py passes `request.tools`)."""
    request = request_for(s)
    # Production hands render_prompt the HF tokenizer inside mlx's wrapper.
    hf = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
    rendered = render_prompt(hf, request.prompt, request.reasoning, len(hf), tools=request.tools)
    return list(rendered.token_ids)


def template_prompt(tokenizer: Any, s: Script) -> list[int]:
    """The same prompt straight from the chat template, as transformers documents it."""
    if s.kind == "completion":
        assert s.prompt is not None
        return list(tokenizer.encode(s.prompt, add_special_tokens=False))
    tools = {"tools": s.tool_dicts} if s.tools else {}
    text = tokenizer.apply_chat_template(
        s.template_messages, add_generation_prompt=True, tokenize=False,
        **s.template_kwargs, **tools,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def expected_tokens(tokenizer: Any, s: Script) -> list[int]:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return [*tokenizer.encode(s.expected_text, add_special_tokens=False), eos]


def greedy_tokens(model: Any, tokenizer: Any, prompt: list[int]) -> list[int]:
    """A plain argmax loop over mlx_lm's generate_step (its default sampler is argmax)."""
    tokens: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
        tokens.append(int(token))
        if tokens[-1] in tokenizer.eos_token_ids:
            break
    return tokens


@pytest.mark.parametrize("sid", SCRIPT_IDS)
def test_greedy_generation_reproduces_the_script(loaded: tuple[Any, Any], sid: str) -> None:
    model, tokenizer = loaded
    s = script(sid)
    prompt = production_prompt(tokenizer, s)
    assert greedy_tokens(model, tokenizer, prompt) == expected_tokens(tokenizer, s)

    greedy = make_sampler(temp=0.0)
    responses = list(
        stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, sampler=greedy)
    )
    assert responses[-1].finish_reason == "stop"
    assert responses[-1].token == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "".join(r.text for r in responses) == s.expected_text


def test_generate_returns_the_answer_text(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    s = script("riddle-think")
    prompt = production_prompt(tokenizer, s)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)
    assert text == s.expected_text
    assert text.split("</think>\n\n")[1] == s.answer


def test_hf_tokenizer_matches_the_mlx_wrapper(loaded: tuple[Any, Any]) -> None:
    _, wrapper = loaded
    hf = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny")))
    for s in load_scripts():
        assert production_prompt(hf, s) == template_prompt(hf, s), s.id
        assert template_prompt(hf, s) == template_prompt(wrapper, s), s.id
        # The think markers survive skip_special_tokens, the eos does not.
        decoded = hf.decode(expected_tokens(hf, s), skip_special_tokens=True)
        assert decoded == s.expected_text, s.id


def run_batch(generator: BatchGenerator, out: dict[int, list[int]], until_done: set[int]) -> None:
    """Step the generator until every uid in `until_done` has finished."""
    while until_done:
        for r in generator.next_generated():
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                assert r.finish_reason == "stop"
                until_done.discard(r.uid)


def test_batch_generator_matches_single_generation(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    scripts = load_scripts()
    prompts = [production_prompt(tokenizer, s) for s in scripts]
    generator = BatchGenerator(
        model, max_tokens=MAX_TOKENS, stop_tokens=[[t] for t in tokenizer.eos_token_ids]
    )
    try:
        uids = generator.insert(prompts)
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        run_batch(generator, out, set(uids))
    finally:
        generator.close()
    for s, prompt, uid in zip(scripts, prompts, uids, strict=True):
        single = greedy_tokens(model, tokenizer, prompt)
        assert out[uid] == single == expected_tokens(tokenizer, s), s.id


def test_continuous_batching_with_staggered_arrivals(loaded: tuple[Any, Any]) -> None:
    # Requests joining a batch mid-decode see different padding and batch sizes.
    model, tokenizer = loaded
    first = [script(i) for i in ("feathers-think", "unicode", "count-completion", "tool-result")]
    later = [script(i) for i in ("cities", "riddle-nothink", "story-completion", "markup",
                                 "tool-parallel")]
    generator = BatchGenerator(
        model,
        max_tokens=MAX_TOKENS,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        prefill_batch_size=2,
        completion_batch_size=4,
    )
    try:
        early = generator.insert([production_prompt(tokenizer, s) for s in first])
        out: dict[int, list[int]] = {uid: [] for uid in early}
        for _ in range(5):
            for r in generator.next_generated():
                out[r.uid].append(r.token)
        late = generator.insert([production_prompt(tokenizer, s) for s in later])
        out.update({uid: [] for uid in late})
        run_batch(generator, out, {u for u in early + late if not _finished(out[u], tokenizer)})
    finally:
        generator.close()
    for s, uid in zip(first + later, early + late, strict=True):
        assert out[uid] == expected_tokens(tokenizer, s), s.id


def _finished(tokens: list[int], tokenizer: Any) -> bool:
    return bool(tokens) and tokens[-1] in tokenizer.eos_token_ids
