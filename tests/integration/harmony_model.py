"""A tiny model that speaks Harmony (gpt-oss's format), for the replica's Harmony path.

The built-in model speaks Qwen3; this one is trained, like it, to reproduce a few scripted
turns exactly, but its tokenizer has Harmony's markers as special tokens, its chat template
writes Harmony headers, and every completion is written by `openai-harmony`'s own encoder
(its vocabulary comes offline from `tests/harmony_vocab.py`). `replicas.builtin`'s pieces
are used as a library: the `qwen3` architecture, `train()` with its margin check and
`verify_model_dir`. Built once per content hash under `$ORCHARD_CACHE_DIR/harmony/` (else
`~/.cache/orchard/harmony/`), with an flock and a temporary directory renamed into place.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3
from mlx_lm.utils import load_tokenizer
from tokenizers import Tokenizer

from replicas.builtin.build import cached_build, orchard_cache
from replicas.builtin.recipe import Architecture, Training
from replicas.builtin.tokenizer_files import train_tokenizer, write_json
from replicas.builtin.train import BuildError, Example, train
from replicas.builtin.verify import verify_model_dir
from replicas.contract import ChatMessage, ChatPrompt, ReasoningSpec
from replicas.pipeline.prompt import render_prompt
from tests.harmony_vocab import load_gpt_oss_encoding, render_completion

PAD = "<|endoftext|>"
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
           "<|return|>", "<|call|>")
EOS = ("<|return|>", "<|call|>")  # gpt-oss ends a turn on either
# Harmony's conversation layout for plain user turns, then the open assistant header; the
# build checks it against the encoder's `render_conversation_for_completion`.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
ARCHITECTURE = Architecture(
    hidden_size=128, num_hidden_layers=2, intermediate_size=384, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
)
TRAINING = Training(learning_rate=3e-3, warmup_steps=20, weight_decay=0.0, check_every=10,
                    max_steps=400, min_margin=6.0)
SEED = 20251122
WEATHER_ARGS = '{"city":"Paris"}'


@dataclass(frozen=True)
class HarmonyScript:
    id: str
    user: str
    # (channel, text, recipient) messages the assistant writes, in order
    reply: tuple[tuple[str, str, str | None], ...]


SCRIPTS = (
    HarmonyScript("greet", "Hi there", (
        ("analysis", "The user says hi. I greet the user.", None),
        ("final", "Hello, dear user! How can I help?", None))),
    HarmonyScript("weather", "What is the weather in Paris?", (
        ("analysis", "Need the weather. I call get_weather.", None),
        ("commentary", WEATHER_ARGS, "functions.get_weather"))),
    HarmonyScript("direct", "Say yes", (("final", "Yes.", None),)),
)


def script(sid: str) -> HarmonyScript:
    return next(s for s in SCRIPTS if s.id == sid)


def chat_prompt(s: HarmonyScript) -> ChatPrompt:
    return ChatPrompt((ChatMessage("user", s.user),))


def _messages(s: HarmonyScript) -> tuple[Any, list[Any]]:
    from openai_harmony import Message, Role  # type: ignore[import-untyped]

    user = Message.from_role_and_content(Role.USER, s.user)
    reply = []
    for channel, text, recipient in s.reply:
        m = Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)
        if recipient:
            m = m.with_recipient(recipient).with_content_type("<|constrain|>json")
        reply.append(m)
    return user, reply


def rendered(s: HarmonyScript) -> tuple[str, str]:
    """(prompt, completion) as openai-harmony writes them; the completion ends in eos."""
    from openai_harmony import Conversation, Role

    encoding = load_gpt_oss_encoding()
    user, reply = _messages(s)
    prompt = encoding.render_conversation_for_completion(
        Conversation.from_messages([user]), Role.ASSISTANT)
    return encoding.decode(prompt), render_completion(encoding, reply)


def cache_root() -> Path:
    return orchard_cache("harmony")


def ensure_harmony_model(root: Path | None = None) -> Path:
    texts = {s.id: rendered(s) for s in SCRIPTS}
    return cached_build(root or cache_root(), _cache_key(texts), lambda tmp: build(tmp, texts))


def _tokenizer(corpus: list[str]) -> Tokenizer:
    added = (PAD, *MARKERS)
    return train_tokenizer(corpus, 400 + len(added), 2, special=added, plain=())


def _write_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> dict[str, int]:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in (PAD, *MARKERS)}
    write_json(out_dir / "tokenizer_config.json", {
        "add_bos_token": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True} for t, i in ids.items()},
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS[0],
        "model_max_length": ARCHITECTURE.max_position_embeddings,
        "pad_token": PAD,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    return ids


def build(out_dir: Path, texts: dict[str, tuple[str, str]]) -> dict[str, Any]:
    corpus = []
    for prompt, completion in texts.values():
        for marker in (*MARKERS, PAD):
            prompt, completion = prompt.replace(marker, "\n"), completion.replace(marker, "\n")
        corpus += [prompt, completion]
    tokenizer = _tokenizer(corpus)
    ids = _write_tokenizer(tokenizer, out_dir)
    eos = [ids[t] for t in EOS]
    config = ARCHITECTURE.config(tokenizer.get_vocab_size(), eos[0], ids[PAD], "float32")
    config["eos_token_id"] = eos
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json",
               {"bos_token_id": ids[PAD], "eos_token_id": eos, "pad_token_id": ids[PAD]})

    hf = load_tokenizer(out_dir)._tokenizer
    examples = []
    for s in SCRIPTS:
        prompt_text, completion = texts[s.id]
        served = render_prompt(hf, chat_prompt(s), ReasoningSpec(), config["vocab_size"])
        if served.text != prompt_text:  # the template must write what the encoder writes
            raise BuildError(f"{s.id}: template {served.text!r} != harmony {prompt_text!r}")
        examples.append(Example(s.id, tuple(served.token_ids),
                                tuple(hf.encode(completion, add_special_tokens=False))))
    mx.random.seed(SEED)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    report = train(model, examples, ids[PAD], TRAINING)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    verify_model_dir(out_dir, examples)
    info = {"vocab_size": config["vocab_size"], "steps": report.steps,
            "seconds": round(report.seconds, 2), "min_margin": round(report.min_margin, 3)}
    write_json(out_dir / "build_info.json", info)
    return info


def _cache_key(texts: dict[str, tuple[str, str]]) -> str:
    sources = [Path(__file__)] + sorted(Path(train.__code__.co_filename).parent.glob("*.py"))
    material = {
        "texts": texts,
        "architecture": asdict(ARCHITECTURE),
        "training": asdict(TRAINING),
        "seed": SEED,
        "sources": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sources},
        "versions": {n: version(n) for n in ("mlx", "mlx-lm", "tokenizers", "transformers")},
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return f"harmony-{digest[:12]}"
