"""Guided decoding cost on a random-weight qwen3: setup, mask per token, decode throughput.

    python -m load.micro.guided [--batch 1 4] [--max-tokens 96] [--repeat 2]

Offline: the tokenizer is a byte-level BPE trained here on mlx-lm's own source files
(a few thousand ids), the model has random weights (about 13 ms a step on 2 CPU cores, the
order of a small model's step on Apple silicon). Prints mean grammar setup time
(compile_guided + GuidedMatcher), mask time per token (mean and p99, bitmask + MLX apply),
and greedy decode tokens/s through mlx-lm's BatchGenerator with and without a json_schema,
with the ratio. Targets: setup < 10 ms; constrained >= 0.85x unconstrained.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.qwen3 import Model, ModelArgs
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from load.micro.guided_loop import Decode, decode, mask_us
from replicas.contract import GuidedSpec
from replicas.pipeline.guided import (
    GuidedMatcher,
    GuidedTokenizer,
    compile_guided,
)

EOS, IM_END = "<|endoftext|>", "<|im_end|>"
VOCAB = 4096
PADDED_IDS = 64  # logits wider than the tokenizer, as real checkpoints are
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 0},
                    "price": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["name", "qty", "tags"],
                "additionalProperties": False,
            },
            "minItems": 3,  # more structure per answer than one short object
        },
        "status": {"enum": ["draft", "final"]},
    },
    "required": ["title", "items", "status"],
    "additionalProperties": False,
}
SPEC = GuidedSpec("json_schema", json.dumps(SCHEMA))
# A whole object SCHEMA admits, written as the grammar writes JSON (no blanks): the mask is
# timed over every kind of position in it (keys, strings, numbers, arrays, the enum, the
# end), not over whatever prefix a random model's output reached before max_tokens.
WHOLE = json.dumps({
    "title": "Weekly order for the corner shop",
    "items": [
        {"name": "apples", "qty": 12, "price": 0.45, "tags": ["fruit", "fresh"]},
        {"name": "flour", "qty": 3, "price": 2.1, "tags": ["baking"]},
        {"name": "olive oil", "qty": 2, "tags": ["pantry", "imported", "glass"]},
        {"name": "rice", "qty": 5, "price": 1.99, "tags": []},
    ],
    "status": "final",
}, separators=(",", ":"))
PROMPT = "Return the order as JSON with a title, the items and a status."


def spec_grammar() -> str:
    return compile_guided(SPEC)


def build_tokenizer() -> PreTrainedTokenizerFast:
    sources = sorted(Path(mlx_lm.__file__).parent.rglob("*.py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[EOS, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator((p.read_text() for p in sources), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def build_model(vocab_size: int) -> Model:
    mx.random.seed(0)
    net = Model(ModelArgs(
        model_type="qwen3", hidden_size=384, num_hidden_layers=6, intermediate_size=1024,
        num_attention_heads=8, num_key_value_heads=4, head_dim=48, rms_norm_eps=1e-6,
        vocab_size=vocab_size, max_position_embeddings=4096, rope_theta=1e6,
        tie_word_embeddings=True,
    ))
    net.update(tree_map(lambda p: 3.0 * p, net.parameters()))  # less repetitive greedy text
    mx.eval(net.parameters())
    return net


def setup_ms(tok: GuidedTokenizer, n: int = 200) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        GuidedMatcher(tok, compile_guided(SPEC))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.mean(times))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=2)
    return parser


def main() -> None:
    args = build_parser().parse_args()

    hf = build_tokenizer()
    eos = [hf.get_vocab()[EOS], hf.get_vocab()[IM_END]]
    start = time.perf_counter()
    tok = GuidedTokenizer.from_hf(hf, vocab_size=len(hf) + PADDED_IDS, eos_token_ids=eos)
    tokenizer_ms = 1e3 * (time.perf_counter() - start)
    model = build_model(tok.vocab_size)
    prompt = hf.encode(PROMPT)
    print(f"mlx {mx.__version__} on {mx.default_device()}; tokenizer {len(hf)} ids, "
          f"logits {tok.vocab_size}; GuidedTokenizer built once in {tokenizer_ms:.1f} ms")

    for constrained in (True, False):  # warm up: mx.compile traces, allocator caches
        decode(model, tok, prompt, 1, 8, constrained, spec_grammar)
    print(f"grammar setup (compile + matcher): {setup_ms(tok):.2f} ms mean")

    for batch in args.batch:
        # The grammar ends the answer when it is complete; the unconstrained run then gets
        # the same length, since tokens/s falls as the KV cache grows. Best of `repeat`,
        # alternating, to damp noise from other work on the machine.
        runs: dict[bool, list[Decode]] = {True: [], False: []}
        for _ in range(args.repeat):
            runs[True].append(decode(model, tok, prompt, batch, args.max_tokens, guided=True,
                                        grammar=spec_grammar))
            length = max(len(o) for o in runs[True][-1].outputs)
            runs[False].append(decode(model, tok, prompt, batch, length, guided=False))
        guided, free = (max(runs[g], key=lambda d: d.tokens_per_s) for g in (True, False))
        answer = hf.decode([t for t in guided.outputs[0] if t not in eos])
        ended = "grammar complete" if guided.outputs[0][-1] in eos else "hit max tokens"
        print(f"batch {batch}: unconstrained {free.tokens_per_s:6.1f} tok/s "
              f"({free.tokens} tokens), json_schema {guided.tokens_per_s:6.1f} tok/s "
              f"({guided.tokens} tokens), ratio {guided.tokens_per_s / free.tokens_per_s:.2f}")
        print(f"  constrained output [0] ({ended}): {answer[:70]!r}"
              f"{'...' if len(answer) > 70 else ''}")

    whole = hf.encode(WHOLE)
    mean, p99 = mask_us(tok, [*whole, eos[0]], compile_guided(SPEC))
    print(f"mask per token over a whole object ({len(whole)} tokens, then eos): "
          f"{mean:.0f} us mean, {p99:.0f} us p99")


if __name__ == "__main__":
    main()
