#!/bin/bash
# Session 73, call 4 (2 H200s): (a) torch's all_to_all_vdev beside the grouped GEMM across both
# GPUs, 3 runs (bench_contention --loads symm_vdev, now on the NVSHMEM backend: call 1's runs
# got "NYI" from the CUDA backend); (b) on GPU 0, the Mixtral-like proxy's training step by
# dispatch and graph scope, 3 interleaved rounds of 30 steps: the default path, the budget
# dispatch (no host read in the step), and the budget dispatch in a full-iteration graph
# (no host launch in the step): how much of the step's host gap each removes (issue 60).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
C=$OUT/c4; mkdir -p $C
{ git log --oneline -1; nvidia-smi -L; python -c "import torch,triton,sys;print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), triton.__version__, sys.version.split()[0])"; } > $C/versions.txt 2>&1
git diff HEAD > $C/tree.diff
pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
for i in 1 2 3; do
  mkdir -p $C/symm_vdev_$i
  timeout 100 python -m torch.distributed.run --standalone --nproc-per-node=2 -m benchmarks.harness.bench_contention --shapes megatron_e32_k4_mbs2x8,qwen3_proxy --loads symm_vdev --computes grouped --iters 10 --out-dir $C/symm_vdev_$i > $C/symm_vdev_$i.log 2>&1
  echo "symm_vdev $i rc=$?"; grep "^| [mq]" $C/symm_vdev_$i.log; grep -m2 "Error\|error:" $C/symm_vdev_$i.log
done
CUDA_VISIBLE_DEVICES=0 timeout 420 python -m benchmarks.harness.bench_train_rounds --warmup 10 --rounds 3 --out $C/mixtral_paths --side 'default=' --side 'budget=--moe-dispatch-budget 1.25' --side 'budget_full=--moe-dispatch-budget 1.25 --cuda-graph-impl full_iteration' -- python -m epoverlap.train --preset mixtral-1gpu-proxy --micro-batch-size 1 --num-microbatches 2 --moe-router-force-load-balancing --train-iters 30 --log-interval 10 > $C/mixtral_paths.log 2>&1
echo "mixtral rc=$?"; tail -8 $C/mixtral_paths.log
cd $C && tar czf $OUT/c4_logs.tgz mixtral_paths/logs *.log 2>/dev/null; ls $C
