#!/bin/bash
# Session 70's last device call (2 H200s). Phase 1, correctness only, side by side: the CP graph
# tests on both GPUs (three pytest processes side by side), the copy-engine transports' GPU tests on GPU 0, the varlen and packed-
# document graph tests on GPU 1. Phase 2, timings, one per GPU: the document-attention bench on
# GPU 1, the one-GPU contention of peer_memory on GPU 0. Phase 3: the 2-GPU contention of NCCL,
# host_memory and peer_memory beside the grouped GEMM.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/a $OUT/c
{ git log --oneline -1; nvidia-smi -L; python -c "import torch,triton;print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), triton.__version__)"; } > $OUT/a/versions.txt 2>&1
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
T="python -m pytest -q -rfE --tb=short -p no:cacheprovider"
for k in test_cp2_graphs per_document dynamic_cp_graphs; do
  (timeout 300 $T -m multigpu tests/graphs/test_gpu_dynamic_cp.py -k $k > $OUT/a/cp_graphs_$k.log 2>&1; echo "rc=$?" >> $OUT/a/cp_graphs_$k.log) &
done
(CUDA_VISIBLE_DEVICES=0 timeout 280 $T -m gpu tests/parallel/test_host_memory.py tests/benchmarks/test_bench_contention.py > $OUT/a/copy_tests.log 2>&1; echo "rc=$?" >> $OUT/a/copy_tests.log) &
(export CUDA_VISIBLE_DEVICES=1; timeout 60 $T -m gpu tests/model/test_varlen.py; echo "rc=$?"; timeout 200 $T -m gpu tests/graphs/test_gpu_documents.py; echo "rc=$?") > $OUT/a/gpu1.log 2>&1
wait
(CUDA_VISIBLE_DEVICES=1 timeout 90 python -m benchmarks.harness.bench_document_attention --rounds 5 --out $OUT/a/doc_attention.json > $OUT/a/doc_attention.log 2>&1) &
CUDA_VISIBLE_DEVICES=0 timeout 95 python -m benchmarks.harness.bench_contention --shapes megatron_e32_k4_mbs2x8,qwen3_proxy --computes grouped,gemm --iters 20 --loads peer_transport,host_transport,d2h_pinned,sm_copy --copy-ctas sms --out-dir $OUT/a/contention_1gpu > $OUT/a/contention_1gpu.log 2>&1
wait
timeout 110 torchrun --standalone --nproc-per-node=2 -m benchmarks.harness.bench_contention --shapes megatron_e32_k4_mbs2x8,qwen3_proxy --loads nccl,host_transport,peer_transport --max-ctas default --computes grouped --iters 10 --out-dir $OUT/c > $OUT/c/contention.log 2>&1; echo "rc=$?" >> $OUT/c/contention.log
for f in a/cp_graphs_*.log a/copy_tests.log a/gpu1.log; do echo "== $f"; tail -8 $OUT/$f; done
tail -12 $OUT/a/doc_attention.log; grep "^|" $OUT/a/contention_1gpu.log | tail -14; grep "^|" $OUT/c/contention.log | tail -14; tail -3 $OUT/c/contention.log
cd $OUT && tar czf s70_final.tgz a c && rm -rf a c
