"""Nemotron-3 Nano output parsers: reasoning (``nano_v3``)."""
