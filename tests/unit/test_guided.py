"""Guided decoding: grammar compilation, the bitmask, and GuidedMatcher step semantics.

The tokenizer is a byte-level BPE trained here in milliseconds, so nothing is downloaded.
`build_hf_tokenizer` and `guided_tokenizer` are shared with the other test_guided_* files.
"""

from __future__ import annotations

import functools
import json

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import replicas.pipeline.guided.bitmask as bitmask_impl
from replicas.contract import GuidedSpec
from replicas.errors import InvalidRequestError
from replicas.pipeline.guided import (
    GuidedLogitsProcessor,
    GuidedMatcher,
    GuidedTokenizer,
    apply_token_bitmask,
    compile_guided,
)
from replicas.pipeline.guided.schema_keywords import unknown_keywords

EOS, IM_END, THINK = "<|endoftext|>", "<|im_end|>", "<think>"
PADDED_IDS = 5  # the model's logits are wider than the tokenizer by this many ids

CORPUS = [
    '{"name": "Alice", "age": 30, "tags": ["a", "b"], "active": true, "score": null}',
    '{"x": 1, "y": -2, "points": [{"x": 0, "y": 10}], "label": "poly", "d": "2024-01-31"}',
    "The quick brown fox jumps over the lazy dog. yes no maybe 0123456789 -3.5e10",
    "red green blue, abc-def ghi_jkl @ . , ; : ( ) [ ] { } \t \n   \n\n  ",
]


@functools.cache
def build_hf_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Byte-level BPE (every byte reachable) with two stop tokens and one other special."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, IM_END, THINK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


@functools.cache
def guided_tokenizer() -> GuidedTokenizer:
    hf = build_hf_tokenizer()
    stops = [hf.get_vocab()[EOS], hf.get_vocab()[IM_END]]
    return GuidedTokenizer.from_hf(hf, vocab_size=len(hf) + PADDED_IDS, eos_token_ids=stops)


def decode(ids: list[int]) -> str:
    text = build_hf_tokenizer().decode(ids, clean_up_tokenization_spaces=False)
    assert isinstance(text, str)
    return text


def allowed_ids(matcher: GuidedMatcher) -> set[int]:
    logits = mx.zeros((1, guided_tokenizer().vocab_size))
    return set(np.flatnonzero(np.isfinite(np.array(matcher.mask(logits))[0])).tolist())


def matcher_for(spec: GuidedSpec) -> GuidedMatcher:
    return GuidedMatcher(guided_tokenizer(), compile_guided(spec))


def feed(matcher: GuidedMatcher, text: str) -> None:
    for token in build_hf_tokenizer().encode(text):
        matcher.mask(mx.zeros((1, guided_tokenizer().vocab_size)))
        matcher.consume(token)


# --- compile_guided --------------------------------------------------------------------

SCHEMA = json.dumps({
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 3}},
    "required": ["a"],
})


@pytest.mark.parametrize("spec", [
    GuidedSpec("json_object"),
    GuidedSpec("json_schema", SCHEMA),
    GuidedSpec("json_schema", "true"),
    GuidedSpec("regex", r"\d{3}-[a-z]+"),
    GuidedSpec("choice", ("yes", "no", 'with "quotes" \\ and\nnewline')),
    GuidedSpec("grammar", 'start: "(" NUM ")"\nNUM: /[0-9]+/'),
])
def test_valid_specs_compile_and_build_a_matcher(spec: GuidedSpec) -> None:
    matcher = matcher_for(spec)
    assert matcher.error is None and not matcher.is_complete


@pytest.mark.parametrize(("spec", "expected"), [
    (GuidedSpec("json_schema", "{not json"), "not valid JSON"),
    (GuidedSpec("json_schema", "[1, 2]"), "must be an object"),
    (GuidedSpec("json_schema", "false"), "accepts no output"),
    (GuidedSpec("json_schema", '{"type": "objectx"}'), "Invalid type: objectx"),
    (GuidedSpec("json_schema", '{"items": ' * 200 + "{}" + "}" * 200), "recursion limit"),
    (GuidedSpec("json_schema", "[" * 100_000 + "]" * 100_000), "nested too deeply"),
    (GuidedSpec("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'),
     "minimum (5) is greater than maximum (1)"),
    (GuidedSpec("json_schema", '{"$ref": "#/$defs/missing"}'), "/$defs/missing"),
    (GuidedSpec("json_schema", '{"$ref": "https://example.com/s.json"}'), "example.com"),
    (GuidedSpec("json_schema", '{"type": "string", "format": "blorp"}'), "Unknown format"),
    (GuidedSpec("json_schema", '{"type": "string", "pattern": "a(b"}'), "unclosed group"),
    # llguidance knows these keywords but cannot enforce them: 400 in either mode.
    (GuidedSpec("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
    (GuidedSpec("json_schema", '{"type": "array", "uniqueItems": true}', strict=False),
     "uniqueItems"),
    (GuidedSpec("json_schema", '{"not": {"type": "string"}}', strict=False), '"not"'),
    # A schema's own x-guidance cannot switch lenient mode back on.
    (GuidedSpec("json_schema", '{"type": "array", "contains": {}, "x-guidance": '
                               '{"lenient": true}}'), "contains"),
    # Unknown keywords would be silently ignored by llguidance: strict refuses them.
    (GuidedSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "string", '
                               '"maxLenght": 3}}}'), "#/properties/a/maxLenght"),
    (GuidedSpec("json_schema", '{"type": ["string", "null"], "nullable": true}'),
     "#/nullable"),
    (GuidedSpec("json_schema", '{"oneOf": [{"type": "integer"}, {"type": "number"}]}'),
     "oneOf"),
    (GuidedSpec("regex", "a(b"), "unclosed group"),
    (GuidedSpec("regex", "(?=a)a"), "look-around"),
    (GuidedSpec("regex", r"(a)\1"), "backreferences"),
    (GuidedSpec("choice", ()), "at least one choice"),
    (GuidedSpec("choice", ("a", 3)), "must all be strings"),  # type: ignore[arg-type]
    (GuidedSpec("grammar", "start: foo"), 'unknown name: "foo"'),
    (GuidedSpec("grammar", 'start: "a" (  '), "invalid guided_grammar"),
    (GuidedSpec("grammar", "   "), "empty"),
    (GuidedSpec("regex", None), "takes the pattern"),
    (GuidedSpec("bogus"), "unknown guided decoding kind"),  # type: ignore[arg-type]
])
def test_invalid_specs_are_invalid_requests_naming_the_problem(
    spec: GuidedSpec, expected: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        compile_guided(spec)
    assert expected in info.value.message


def test_non_strict_relaxes_unknown_keywords_and_one_of() -> None:
    for schema in ('{"type": "string", "nullable": true}',
                   '{"oneOf": [{"type": "integer"}, {"type": "number"}]}'):
        assert compile_guided(GuidedSpec("json_schema", schema, strict=False))


def test_unknown_keywords_walks_every_subschema_position() -> None:
    schema = {
        "type": "object",
        "x-vendor": 1,
        "properties": {"foo": {"bar": 1}, "a/b": {"items": {"baz": 1}}},
        "anyOf": [{"qux": 1}, True],
        "$defs": {"d": {"additionalProperties": {"quux": 1}}},
        "dependencies": {"foo": ["a/b"], "z": {"corge": 1}},
        "enum": [{"not_a_schema": 1}],
    }
    assert sorted(unknown_keywords(schema)) == sorted([
        "#/properties/foo/bar",
        "#/properties/a~1b/items/baz",
        "#/anyOf/0/qux",
        "#/$defs/d/additionalProperties/quux",
        "#/dependencies/z/corge",
    ])


# --- bitmask ---------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(1, 200),
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([mx.float32, mx.float16, mx.bfloat16]),
)
def test_bitmask_apply_matches_a_bit_by_bit_reference(vocab: int, seed: int,
                                                       dtype: mx.Dtype) -> None:
    rng = np.random.default_rng(seed)
    words = rng.integers(-(2**31), 2**31, size=(1, (vocab + 31) // 32)).astype(np.int32)
    logits = rng.standard_normal((1, vocab)).astype(np.float32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)
    rounded = np.array(mx.array(logits).astype(dtype).astype(mx.float32))[0]
    expected = np.where(bits, rounded, -np.inf)
    out = apply_token_bitmask(mx.array(logits).astype(dtype), mx.array(words))
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.array(out.astype(mx.float32))[0], expected)


@pytest.mark.skipif(mx.metal.is_available(), reason="needs a machine without Metal")
def test_a_metal_kernel_that_cannot_run_falls_back_to_the_portable_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    bitmask_impl._implementation.cache_clear()
    try:
        assert bitmask_impl._implementation() is bitmask_impl._apply_unpacked
    finally:
        bitmask_impl._implementation.cache_clear()


# --- GuidedMatcher ---------------------------------------------------------------------

def test_tokenizer_rejects_a_logits_width_below_the_vocabulary() -> None:
    hf = build_hf_tokenizer()
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        GuidedTokenizer.from_hf(hf, vocab_size=len(hf) - 1, eos_token_ids=[0])
    with pytest.raises(ValueError, match="at least one"):
        GuidedTokenizer.from_hf(hf, vocab_size=len(hf), eos_token_ids=[])


def test_padded_and_special_ids_are_never_allowed_and_every_stop_id_ends() -> None:
    hf, tok = build_hf_tokenizer(), guided_tokenizer()
    matcher = matcher_for(GuidedSpec("regex", r"(?s:.*)"))  # any text at all
    allowed = allowed_ids(matcher)
    assert allowed, "free text must allow something"
    assert max(allowed) < len(hf), "padded ids beyond the tokenizer leaked"
    assert hf.get_vocab()[THINK] not in allowed
    assert set(tok.eos_token_ids) <= allowed  # `.*` is already satisfied


def test_completion_allows_only_stop_ids_and_reports_complete() -> None:
    tok = guided_tokenizer()
    matcher = matcher_for(GuidedSpec("choice", ("yes", "no")))
    assert not matcher.is_complete
    feed(matcher, "yes")
    assert matcher.is_complete and matcher.error is None
    assert allowed_ids(matcher) == set(tok.eos_token_ids)
    matcher.consume(tok.eos_token_ids[1])  # any stop id is the end; consuming it is fine
    assert matcher.is_complete and matcher.error is None


def test_open_ended_grammar_completes_when_a_stop_id_is_consumed() -> None:
    tok = guided_tokenizer()
    matcher = matcher_for(GuidedSpec("regex", "[0-9]+"))
    feed(matcher, "12")
    assert not matcher.is_complete  # "123" is still possible
    assert set(tok.eos_token_ids) <= allowed_ids(matcher)
    matcher.consume(tok.eos_token_ids[0])
    assert matcher.is_complete and matcher.error is None


def test_a_forbidden_token_is_an_error_and_leaves_only_stop_ids() -> None:
    tok = guided_tokenizer()
    matcher = matcher_for(GuidedSpec("choice", ("yes", "no")))
    matcher.consume(build_hf_tokenizer().encode("z")[0])
    assert matcher.error is not None and "doesn't satisfy the grammar" in matcher.error
    assert len(matcher.error) < 500, "errors must stay short (no parser state dump)"
    assert not matcher.is_complete
    assert allowed_ids(matcher) == set(tok.eos_token_ids)


def test_mask_rejects_logits_of_the_wrong_width() -> None:
    matcher = matcher_for(GuidedSpec("json_object"))
    with pytest.raises(ValueError, match="logits width"):
        matcher.mask(mx.zeros((1, guided_tokenizer().vocab_size - 1)))


def test_logits_processor_consumes_only_tokens_after_the_prompt() -> None:
    hf, tok = build_hf_tokenizer(), guided_tokenizer()
    grammar = compile_guided(GuidedSpec("choice", ("yes", "no")))
    processor = GuidedLogitsProcessor(GuidedMatcher(tok, grammar))
    prompt = hf.encode("The quick brown fox")  # not valid for the grammar: must be skipped
    answer = hf.encode("no")
    logits = mx.zeros((1, tok.vocab_size))
    history = list(prompt)
    processor(mx.array(history), logits)
    for token in answer:
        history.append(token)
        masked = processor(mx.array(history), logits)
    assert processor.matcher.error is None and processor.matcher.is_complete
    assert set(np.flatnonzero(np.isfinite(np.array(masked)[0]))) == set(tok.eos_token_ids)


# --- grammar fast-forward: drafts of what the grammar forces -----------------------------

def test_forced_after_drafts_what_the_grammar_forces_and_leaves_the_state_alone() -> None:
    choice = matcher_for(GuidedSpec("choice", ("green apple", "red")))
    hf = build_hf_tokenizer()
    green, *rest = hf.encode("green apple")
    before = allowed_ids(choice)
    forced = choice.forced_after(green, 10)
    assert decode([green, *forced]) == "green apple" and forced == rest
    assert allowed_ids(choice) == before  # nothing consumed
    assert choice.forced_after(green, 1) == rest[:1]
    assert choice.forced_after(hf.encode("x")[0], 5) == []  # a token it forbids: no draft
    assert choice.error is None
    choice.consume(green)
    assert choice.forced_after(rest[0], 10) == rest[1:]
