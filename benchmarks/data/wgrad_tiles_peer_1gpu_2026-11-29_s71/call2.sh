#!/bin/bash
# Session 71, call 2 (one H200): the weight-grad kernel's tiles taken group_i input blocks at a
# time (L2 reuse of grad's blocks at Mixtral's wide fc1) with and without TMA, at every proxy's step
# shape (two microbatches' sources, overwriting) and the Qwen3 proxy's one-microbatch adds;
# then the logit GEMMs in 3 separate processes (forward layouts with today's timed again last;
# forward, input grad and weight grad as the step runs them, the weight grad into fp32).
set -u
mkdir -p $OUT/c2
{ git log --oneline -1; nvidia-smi -L; python -c "import torch,triton,sys;print(torch.__version__, torch.version.cuda, triton.__version__, sys.version.split()[0])"; } > $OUT/c2/versions.txt 2>&1
git diff HEAD > $OUT/c2/tree.diff
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 330 python -m benchmarks.harness.bench_wgrad --sweep --shapes mixtral-step,qwen3-experts --rounds 5 --iters 5 > $OUT/c2/bench_wgrad.log 2>&1; echo "bench_wgrad rc=$?"
grep -E "left out" $OUT/c2/bench_wgrad.log
grep -E "^\|" $OUT/c2/bench_wgrad.log | awk -F'|' '{printf "%s|%s|%s|%s|%s\n", substr($2,1,22), $3, $4, $5, $9}'
for r in 1 2 3; do
  timeout 60 python -m benchmarks.harness.bench_gemm_shapes --logit-variants --out $OUT/c2/logit_variants_r$r.json > $OUT/c2/logit_variants_r$r.log 2>&1; echo "logit variants round $r rc=$?"
  timeout 90 python -m benchmarks.harness.bench_gemm_shapes --out $OUT/c2/gemm_shapes_r$r.json > $OUT/c2/gemm_shapes_r$r.log 2>&1; echo "gemm shapes round $r rc=$?"
done
cd $OUT && tar czf s71_call2.tgz c2 && rm -rf c2
