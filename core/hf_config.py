"""``config.json`` as an attribute-access object, without depending on transformers."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class HFConfig:
    """Nested dicts become nested ``HFConfig``; missing attributes raise ``AttributeError``."""

    def __init__(self, data: dict[str, Any]) -> None:
        for key, value in data.items():
            setattr(self, key, HFConfig(value) if isinstance(value, dict) else value)

    @classmethod
    def from_file(cls, path: str | Path) -> HFConfig:
        with open(path) as f:
            return cls(json.load(f))

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)

    def to_dict(self) -> dict[str, Any]:
        return {k: v.to_dict() if isinstance(v, HFConfig) else v for k, v in vars(self).items()}

    def __repr__(self) -> str:
        return f"HFConfig({self.to_dict()!r})"
