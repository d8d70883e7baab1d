#!/bin/bash
# Session 73, call 1 (2 H200s): on GPU 0 the GPU tests of session 72's review mends (the grad
# norm's squares kernel and its spans, the optimizer, the step's timing); then recipe
# copy_engine_a2a_2gpu across both GPUs: NCCL at default, 8, 4, 2 CTAs, host_memory and
# peer_memory, and torch's all_to_all_vdev, each alone and beside the grouped GEMM, 3 rounds.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
C=$OUT/c1; mkdir -p $C
{ git log --oneline -1; nvidia-smi -L; python -c "import torch,triton,sys;print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), triton.__version__, sys.version.split()[0])"; } > $C/versions.txt 2>&1
git diff HEAD > $C/tree.diff
pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 150 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m "gpu and not multigpu" tests/kernels/test_square_sums.py tests/training/test_optim.py tests/kernels/test_adamw.py tests/training/test_step_timing.py tests/training/test_grad_placement.py > $C/tests_mends.log 2>&1
echo "tests rc=$?"; tail -3 $C/tests_mends.log
python -m benchmarks.gpu.run copy_engine_a2a_2gpu --no-install --out $C --time-limit 430 2>&1 | tail -4
tar xzf $C/copy_engine_a2a_2gpu.tgz -C /tmp 2>/dev/null
grep -h "^| [mq]" /tmp/copy_engine_a2a_2gpu/*.log 2>/dev/null | head -60
