"""Prompt rendering: chat messages through the model's own chat template, or raw text/ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replicas.contract import ChatPrompt, Prompt, ReasoningSpec, TextPrompt, TokenPrompt
from replicas.errors import InvalidRequestError


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: tuple[int, ...]
    text: str  # the template output; the channel router reads its tail


def render_prompt(
    hf_tokenizer: Any, prompt: Prompt, reasoning: ReasoningSpec, vocab_size: int
) -> RenderedPrompt:
    if isinstance(prompt, ChatPrompt):
        text = render_chat_text(hf_tokenizer, prompt, reasoning)
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(prompt, TextPrompt):
        text = prompt.text
        ids = hf_tokenizer.encode(text)
    elif isinstance(prompt, TokenPrompt):
        ids = list(prompt.token_ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                param="prompt",
            )
        text = hf_tokenizer.decode(ids, skip_special_tokens=False)
    else:  # pragma: no cover - the union is closed
        raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}")
    if not ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    return RenderedPrompt(tuple(ids), text)


def render_chat_text(hf_tokenizer: Any, prompt: ChatPrompt, reasoning: ReasoningSpec) -> str:
    if getattr(hf_tokenizer, "chat_template", None) is None:
        raise InvalidRequestError(
            "this model has no chat template; use /v1/completions", param="messages"
        )
    messages: list[dict[str, str]] = []
    for message in prompt.messages:
        entry = {"role": message.role, "content": message.content}
        if message.reasoning:
            entry["reasoning_content"] = message.reasoning
        messages.append(entry)
    # A trailing assistant message is a prefill: the model continues it.
    prefill = bool(messages) and messages[-1]["role"] == "assistant"
    kwargs = dict(reasoning.template_kwargs)
    if reasoning.enabled is not None:
        kwargs["enable_thinking"] = reasoning.enabled
    if reasoning.effort is not None:
        kwargs["reasoning_effort"] = reasoning.effort
    try:
        return str(
            hf_tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=not prefill,
                continue_final_message=prefill,
                **kwargs,
            )
        )
    except Exception as exc:  # jinja raises for e.g. roles that do not alternate
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}",
                                  param="messages") from exc
