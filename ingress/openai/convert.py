"""OpenAI wire requests -> GenerationRequest."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace

from ingress.effort import effort_reasoning
from ingress.media import MediaParts
from ingress.openai.choices import MAX_PROMPTS
from ingress.openai.models import ChatCompletionRequest, CompletionRequest, SamplingFields
from ingress.openai.tools import chat_messages, tool_choice, tool_specs
from replicas.contract import (
    ChatPrompt,
    GenerationRequest,
    GuidedSpec,
    Prompt,
    ReasoningSpec,
    SamplingParams,
    StopSpec,
    TextPrompt,
    TokenPrompt,
)
from replicas.errors import InvalidRequestError


def chat_request(body: ChatCompletionRequest, model: str,
                 media: MediaParts | None = None) -> GenerationRequest:
    """The request, its media parts as `media` decides (none given: placeholders); where
    `media` reads images, await `media.resolve` on it before it goes anywhere."""
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    messages = chat_messages(body.messages, MediaParts() if media is None else media)
    tools = tool_specs(body)
    choice = tool_choice(body, tools)
    kwargs = dict(body.chat_template_kwargs or {})
    enabled = kwargs.pop("enable_thinking", None)
    # The effort means what it means on the Responses route; the explicit extensions
    # (`enable_thinking`, `thinking_budget`) say more precisely, so they win.
    effort = effort_reasoning(body.reasoning_effort)
    reasoning = ReasoningSpec(
        enabled=bool(enabled) if enabled is not None else effort.enabled,
        budget_tokens=effort.budget_tokens if body.thinking_budget is None
        else body.thinking_budget,
        effort=effort.effort,
        template_kwargs=kwargs,
    )
    max_tokens = body.max_completion_tokens or body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    request = _request("chatcmpl", body, model, ChatPrompt(messages), reasoning, max_tokens,
                       _guided(body, body.response_format), logprobs)
    return replace(request, tools=tools, tool_choice=choice, session_key=body.prompt_cache_key)


def completion_request(body: CompletionRequest, model: str) -> GenerationRequest:
    """The request for the first prompt (`completion_prompts` has them all)."""
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    if body.best_of not in (None, 1):
        raise InvalidRequestError("best_of must be 1", param="best_of")
    request = _request("cmpl", body, model, completion_prompts(body)[0], ReasoningSpec(),
                       body.max_tokens, _guided(body, None), body.logprobs)
    return replace(request, echo=body.echo)


def _request(prefix: str, body: SamplingFields, model: str, prompt: Prompt,
             reasoning: ReasoningSpec, max_tokens: int | None,
             guided: GuidedSpec | None, logprobs: int | None) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        model=model,
        prompt=prompt,
        sampling=replace(_sampling(body, max_tokens), logprobs=logprobs),
        stop=StopSpec(
            strings=body.stop_list(),
            token_ids=tuple(body.stop_token_ids or ()),
            include_in_output=body.include_stop_str_in_output,
        ),
        reasoning=reasoning,
        guided=guided,
    )


def _sampling(body: SamplingFields, max_tokens: int | None) -> SamplingParams:
    try:
        bias = {int(k): float(v) for k, v in (body.logit_bias or {}).items()}
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias") from None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        min_p=body.min_p or 0.0,
        seed=body.seed,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=bias,
    )


def completion_prompts(body: CompletionRequest) -> list[Prompt]:
    """The request's prompts: one text, one token list, or a list of either."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [TextPrompt(prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [TokenPrompt(tuple(prompt))]  # type: ignore[arg-type]
    prompts: list[Prompt] = [TextPrompt(p) if isinstance(p, str)
                             else TokenPrompt(tuple(p))  # type: ignore[arg-type]
                             for p in prompt]
    if not prompts:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if len(prompts) > MAX_PROMPTS or len(prompts) * body.n > MAX_PROMPTS:
        raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts (times n) per request",
                                  param="prompt")
    return prompts


def _guided(body: SamplingFields, response_format: object | None) -> GuidedSpec | None:
    specs: list[GuidedSpec] = []
    fmt = response_format
    if fmt is not None and fmt.type == "json_object":  # type: ignore[attr-defined]
        specs.append(GuidedSpec("json_object"))
    elif fmt is not None and fmt.type == "json_schema":  # type: ignore[attr-defined]
        schema = fmt.json_schema  # type: ignore[attr-defined]
        if schema is None or schema.schema_ is None:
            raise InvalidRequestError("response_format.json_schema.schema is required",
                                      param="response_format")
        specs.append(GuidedSpec("json_schema", json.dumps(schema.schema_), bool(schema.strict)))
    if body.guided_json is not None:
        text = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
        specs.append(GuidedSpec("json_schema", text))
    if body.guided_regex is not None:
        specs.append(GuidedSpec("regex", body.guided_regex))
    if body.guided_choice is not None:
        specs.append(GuidedSpec("choice", tuple(body.guided_choice)))
    if body.guided_grammar is not None:
        specs.append(GuidedSpec("grammar", body.guided_grammar))
    if len(specs) > 1:
        raise InvalidRequestError("use only one of response_format and the guided_* options",
                                  param="response_format")
    return specs[0] if specs else None
