"""The built-in model's tokenizer, trained from the scripts (no model built), for the
tokenizer and tool-calling tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlx_lm.utils import load_tokenizer
from transformers import AutoTokenizer

from replicas.builtin import load_scripts
from replicas.builtin.recipe import TINY
from replicas.builtin.tokenizer_files import train_tokenizer, training_texts, write_tokenizer_files


# Session-wide: the tokenizer and tool-calling modules read one tokenizer, built once as
# when they were one module.
@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    tokenizer = train_tokenizer(training_texts(load_scripts()), TINY.max_vocab, TINY.min_frequency)
    write_tokenizer_files(tokenizer, out, 4096)
    return out


@pytest.fixture(scope="session")
def hf(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def wrapper(tokenizer_dir: Path) -> Any:
    return load_tokenizer(tokenizer_dir)
