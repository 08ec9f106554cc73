"""``armillary serve`` whose engine step raises once a trigger file exists: the fault test's hook, outside core."""
from __future__ import annotations

import os
import sys

from armillary.cli import main
from armillary.engine import LLMEngine

TRIGGER_ENV = "ARMILLARY_FAULT_TRIGGER"
INJECTED = "CUDA error: an illegal memory access was encountered (injected by the fault test)"


def _install(trigger: str) -> None:
    original = LLMEngine.step

    def step(self, *args, **kwargs):
        if os.path.exists(trigger):  # what a poisoned device context does to the next step
            raise RuntimeError(INJECTED)
        return original(self, *args, **kwargs)

    LLMEngine.step = step


if __name__ == "__main__":
    _install(os.environ[TRIGGER_ENV])
    sys.exit(main(sys.argv[1:]))
