"""Exception types the engine raises; the server maps them onto protocol errors."""
from __future__ import annotations


class ArmillaryError(Exception):
    """Base class of every error armillary raises on purpose."""


class PluginError(ArmillaryError):
    """A plugin is missing, broken, or registers a duplicate name."""


class ModelNotFoundError(ArmillaryError):
    """The model directory or repo id cannot be found locally."""


class WeightLoadError(ArmillaryError):
    """Checkpoint tensors are missing, unused, or do not fit the model."""


class InvalidRequestError(ArmillaryError, ValueError):
    """A request the engine refuses: empty prompt, over the context limit, bad parameters."""
