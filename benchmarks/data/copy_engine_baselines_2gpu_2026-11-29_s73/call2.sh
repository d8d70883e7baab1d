#!/bin/bash
# Session 73, call 2 (2 H200s): recipe copy_transport_step_nvlink_2gpu: megatron-cmp's training
# step over NVLink through NCCL, host_memory and peer_memory, sequential and overlapped with
# delayed wgrads, 3 interleaved rounds.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
C=$OUT/c2; mkdir -p $C
{ git log --oneline -1; nvidia-smi -L; python -c "import torch,triton,sys;print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), triton.__version__, sys.version.split()[0])"; } > $C/versions.txt 2>&1
git diff HEAD > $C/tree.diff
python -m benchmarks.gpu.run copy_transport_step_nvlink_2gpu --no-install --out $C --time-limit 570 2>&1 | tail -4
tar xzf $C/copy_transport_step_nvlink_2gpu.tgz -C /tmp 2>/dev/null
tail -30 /tmp/copy_transport_step_nvlink_2gpu/rounds_nvlink.log 2>/dev/null
