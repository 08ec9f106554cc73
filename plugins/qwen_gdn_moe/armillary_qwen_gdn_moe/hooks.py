"""Entry point of the qwen_gdn_moe plugin."""
from __future__ import annotations

from armillary.hookspecs import hookimpl
