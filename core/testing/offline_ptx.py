"""A Triton kernel's PTX for a GPU target, compiled on any machine (ptxas included, no GPU): for tests that pin
what a kernel's speed or safety rests on (an instruction present, two in order).

The suite interprets kernels (``TRITON_INTERPRET=1`` replaces them where they are defined), so the compile runs
in a fresh interpreter without it. ``signature``: every argument's Triton type (``"*bf16"``, ``"i32"``), constexprs
included as ``"constexpr"``; ``constexprs``: their values.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
job = json.loads(sys.stdin.read())
kernel = getattr(importlib.import_module(job["module"]), job["kernel"])
src = ASTSource(kernel, job["signature"], job["constexprs"])
sys.stdout.write(triton.compile(src, target=GPUTarget("cuda", job["capability"], 32)).asm["ptx"])
"""


def kernel_ptx(module: str, kernel: str, signature: dict[str, str], constexprs: dict, capability: int = 90,
               timeout: float = 600) -> str:
    """PTX of ``module.kernel`` specialised by ``constexprs`` for compute capability ``capability``; raises
    ``RuntimeError`` with the compiler's message when it does not compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    job = json.dumps(dict(module=module, kernel=kernel, signature=signature, constexprs=constexprs,
                          capability=capability))
    proc = subprocess.run([sys.executable, "-c", _COMPILE], input=job, capture_output=True, text=True, env=env,
                          timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{module}.{kernel} did not compile for sm_{capability}:\n{proc.stderr[-4000:]}")
    return proc.stdout


def instruction_sequence(ptx: str, pattern: str) -> list[str]:
    """The matches of ``pattern`` (a regex alternation of instructions) in program order."""
    return [m.group(0) for m in re.finditer(pattern, ptx)]


PDL_MARKS = r"griddepcontrol\.\w+|prefetch\.global\.L2|ld\.global"


def assert_prefetch_before_wait(ptx: str, prefetch: bool, loads_before_wait: int = 0) -> None:
    """A PDL kernel's order: ``launch_dependents`` first, at most ``loads_before_wait`` global loads before
    ``wait`` (inputs no kernel of the step writes, such as a decode graph's slot rows), and its L2 prefetches
    (where ``prefetch``; else none at all) all between the two."""
    marks = instruction_sequence(ptx, PDL_MARKS)
    first_wait = marks.index("griddepcontrol.wait")
    assert marks[0] == "griddepcontrol.launch_dependents", marks[:4]
    assert "ld.global" in marks[first_wait:], marks
    assert marks[:first_wait].count("ld.global") <= loads_before_wait, marks[:first_wait + 1]
    if prefetch:
        assert "prefetch.global.L2" in marks[1:first_wait] and "prefetch.global.L2" not in marks[first_wait:], marks
    else:
        assert "prefetch.global.L2" not in marks, marks
