"""Guided decoding: llguidance grammars mask MLX logits, so answers are valid by construction."""

from replicas.pipeline.guided.bitmask import apply_token_bitmask
from replicas.pipeline.guided.compiler import compile_guided
from replicas.pipeline.guided.matcher import GuidedLogitsProcessor, GuidedMatcher
from replicas.pipeline.guided.tokenizer import GuidedTokenizer
from replicas.pipeline.guided.tools import ToolGrammar, compile_tool_grammar

__all__ = [
    "GuidedLogitsProcessor",
    "GuidedMatcher",
    "GuidedTokenizer",
    "ToolGrammar",
    "apply_token_bitmask",
    "compile_guided",
    "compile_tool_grammar",
]
