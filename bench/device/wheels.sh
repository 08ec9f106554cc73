#!/usr/bin/env bash
# Build .whl/ for the GPU machine, which has no package index: armillary, its bundled plugins, and the
# pure-Python / cp312 packages its image lacks (versions as the CPU suite runs them). Run here before every
# device call that needs the current tree; name .whl in the call's carry, then `source bench/device/setup.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl . plugins/qwen_gdn_moe plugins/llama plugins/gemma \
    plugins/nemotron plugins/glm_flash
rm -rf build plugins/*/build  # setuptools' staging copies: stale ones would shadow edits in the next wheel
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pluggy==1.6.0 gguf==0.19.0 xgrammar==0.2.9 fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 \
    pydantic_core==2.46.4 uvicorn==0.55.0 annotated-types==0.7.0 typing-inspection==0.4.2 2>/dev/null
du -sh .whl
