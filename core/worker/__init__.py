"""Workers: one per device (rank); each owns its share of the model, its caches, graphs and sampler."""
from __future__ import annotations

from armillary.worker.base import Worker
from armillary.worker.model_worker import ModelWorker

__all__ = ["Worker", "ModelWorker"]
