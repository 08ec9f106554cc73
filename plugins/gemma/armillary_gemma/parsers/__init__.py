"""Gemma 4's tool-call and thinking-block parsers (Gemma 3 has no native tool format)."""
