"""Model families: what Orchard knows of each family's output markup, as data.

One module per family (`qwen.py`, `harmony.py`, `gemma.py`, ...), each exporting its
`Family` (`FAMILY`, or `FAMILIES` for two close relatives): its reasoning (channel) format,
its tool format, their detection signatures and its built-in test model's template.
`registry.py` lists them in the one detection order and derives the channel-format and
tool-format tables. The data types are `channel_format.py`, `tool_format.py` and
`family.py`; shared shapes are `reasoning.py` and `tool_layouts.py`. Nothing here imports
the engine, the pipeline or the built-in models (an import-linter contract).
"""
