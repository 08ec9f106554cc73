# Source on the GPU machine, in the repository root, with .whl carried (bench/device/wheels.sh built it):
# installs the wheels into /tmp/site (no index, no compile) and puts it first on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import armillary, torch, triton; print('armillary', armillary.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
