#!/bin/bash
# Session 73, call 7 (2 H200s): one exchange's time by size, host_memory against NCCL with P2P
# off (calls 2, 3 and 6 found host_memory's exchanges slower in the step than alone at 64 MiB):
# bench_contention at megatron-cmp's all-to-all scaled to 1/1024, 1/64 and 1/8 of its rows
# (64 KiB, 1 MiB, 8 MiB per rank), each load alone and beside the grouped GEMM.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_P2P_DISABLE=1
C=$OUT/c7; mkdir -p $C
git diff HEAD > $C/tree.diff; git log --oneline -1 > $C/versions.txt
pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
for s in 0.0009765625 0.015625 0.125; do
  timeout 60 python -m torch.distributed.run --standalone --nproc-per-node=2 -m benchmarks.harness.bench_contention --shapes megatron_e32_k4_mbs2x8 --scale $s --loads nccl,host_transport --max-ctas default --computes grouped --iters 20 --out-dir $C/scale_$s > $C/scale_$s.log 2>&1
  echo "scale $s rc=$?"; grep "sizes:\|^| m" $C/scale_$s.log
done
