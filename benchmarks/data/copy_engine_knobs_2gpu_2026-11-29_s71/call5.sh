#!/bin/bash
# Session 71, call 5 (2 H200s): NCCL's own copy-engine and CTA knobs as baselines for issue 61
# (recipe copy_engine_a2a_2gpu: NCCL's EP all-to-all alone and beside the experts' grouped GEMM
# under each knob, with NCCL's INIT/ENV log of what it took; then host_memory and peer_memory).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/c5
{ git log --oneline -1; nvidia-smi -L; python -c "import torch,triton,sys;print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), triton.__version__, sys.version.split()[0])"; } > $OUT/c5/versions.txt 2>&1
git diff HEAD > $OUT/c5/tree.diff
python -m benchmarks.gpu.run copy_engine_a2a_2gpu --out $OUT/c5 --time-limit 400 2>&1 | tail -5
tar xzf $OUT/c5/copy_engine_a2a_2gpu.tgz -C /tmp 2>/dev/null
for d in /tmp/copy_engine_a2a_2gpu/*/; do echo "== $d"; grep -h "via\|NCCL_P2P_USE\|NCCL_SHM\|CTA" $d/nccl.*.log 2>/dev/null | sort | uniq -c | sort -rn | head -4; done
grep -h "^| [mq]" /tmp/copy_engine_a2a_2gpu/*.log 2>/dev/null | head -40
cd $OUT && tar czf s71_call5.tgz c5 && rm -rf c5
