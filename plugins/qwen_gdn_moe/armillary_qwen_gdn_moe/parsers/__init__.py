"""Qwen3 reasoning and qwen3_coder tool-call parsers (registered lazily by ``hooks.py``)."""
