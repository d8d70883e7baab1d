#!/bin/bash
# Session 70's call 4 (2 H200s): the 2-GPU contention of NCCL, host_memory and peer_memory beside
# the experts' grouped GEMM in 3 rounds (call 3 ran one), then both copy-engine transports with
# 16 MiB slots (4 MiB is the default) for their bandwidth.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
B="torchrun --standalone --nproc-per-node=2 -m benchmarks.harness.bench_contention --shapes megatron_e32_k4_mbs2x8,qwen3_proxy --max-ctas default --computes grouped --iters 10"
for r in 1 2 3; do
  mkdir -p $OUT/r$r; timeout 80 $B --loads nccl,host_transport,peer_transport --out-dir $OUT/r$r > $OUT/r$r/contention.log 2>&1; echo "round $r rc=$?"
  grep "^| [mq]" $OUT/r$r/contention.log
done
mkdir -p $OUT/slot16m; timeout 80 $B --loads host_transport,peer_transport --host-slot-kib 16384 --out-dir $OUT/slot16m > $OUT/slot16m/contention.log 2>&1; echo "slot16m rc=$?"
grep "^| [mq]" $OUT/slot16m/contention.log
cd $OUT && tar czf s70_call4.tgz r1 r2 r3 slot16m && rm -rf r1 r2 r3 slot16m
