#!/bin/bash
# Session 73, call 6 (2 H200s): where megatron-cmp's step goes through host_memory against NCCL
# (calls 2-3 found it slower in every mode): one profiled run per side (steps 10-11 of 14: span
# files with the first rank's comm and exposed comm, torch.profiler traces, their kernel table),
# with P2P off (NCCL through host memory) and over NVLink.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
C=$OUT/c6; mkdir -p $C
{ git log --oneline -1; nvidia-smi -L; python -c "import torch,triton,sys;print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), triton.__version__, sys.version.split()[0])"; } > $C/versions.txt 2>&1
git diff HEAD > $C/tree.diff
pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
RUN="python -m torch.distributed.run --standalone --nproc-per-node=2 -m epoverlap.train --preset megatron-cmp --mock-data --bf16 --expert-model-parallel-size 2 --train-iters 14 --log-interval 1 --tune off --cuda-graph-impl local --cuda-graph-modules attn moe_router moe_preprocess --profile-steps 10:11 --use-pytorch-profiler"
SEQ=--no-overlap-moe-expert-parallel-comm; OVL="--overlap-moe-expert-parallel-comm --delay-wgrad-compute"; HOST="--moe-a2a-transport host_memory"
side() {  # name, env, flags
  local name=$1 envs=$2; shift 2
  env $envs timeout 90 $RUN "$@" --profile-dir /tmp/p6/$name > $C/$name.log 2>&1; echo "$name rc=$?"
  grep -E "^ *(step|iteration)? *1[01]\b|exposed comm" $C/$name.log | tail -2
  python -m benchmarks.harness.kernel_table /tmp/p6/$name --steps 2 --top 12 > $C/$name.ktable.md 2>&1
}
side nop2p_seq NCCL_P2P_DISABLE=1 $SEQ
side nop2p_seq_host NCCL_P2P_DISABLE=1 $SEQ $HOST
side nop2p_ovl NCCL_P2P_DISABLE=1 $OVL
side nop2p_ovl_host NCCL_P2P_DISABLE=1 $OVL $HOST
side nvlink_ovl NCCL_NVLS_ENABLE=0 $OVL
side nvlink_ovl_host NCCL_NVLS_ENABLE=0 $OVL $HOST
cd $C && tar czf $OUT/c6.tgz . && ls
