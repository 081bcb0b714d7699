"""Tool calls out of the TOOL channel: `parser.py` (`ToolCallParser`, `ToolParsing`) and one
incremental reader per call syntax, chosen from `parser.READERS` by the tool format's
`syntax`: `json_reader.py` (with `json_values.py`), `xml_reader.py`, `key_value_reader.py`,
`pythonic_reader.py`, `gemma_reader.py`, `xtml_reader.py`, `raw_reader.py`; `reader.py`
holds what they share.
"""
