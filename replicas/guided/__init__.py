"""Guided decoding: llguidance grammars mask MLX logits, so answers are valid by construction."""

from replicas.guided.bitmask import apply_token_bitmask
from replicas.guided.compiler import compile_guided
from replicas.guided.matcher import GuidedLogitsProcessor, GuidedMatcher
from replicas.guided.tokenizer import GuidedTokenizer
from replicas.guided.tools import ToolGrammar, compile_tool_grammar

__all__ = [
    "GuidedLogitsProcessor",
    "GuidedMatcher",
    "GuidedTokenizer",
    "ToolGrammar",
    "apply_token_bitmask",
    "compile_guided",
    "compile_tool_grammar",
]
