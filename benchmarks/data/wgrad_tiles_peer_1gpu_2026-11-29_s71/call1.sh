#!/bin/bash
# Session 71, call 1 (one H200): the experts' weight-grad kernel with its rows through TMA against
# the pointer loads, at the Mixtral proxy's step shape (2048 rows an expert as two sources of 1024,
# the main grad overwritten) and the Qwen3 proxy's (bench_wgrad --sweep: every config's bits
# against the default's, then 5 rounds of 5 calls, sides alternating); then the logit forward's
# layouts in 3 separate rounds (bench_gemm_shapes --logit-variants).
set -u
mkdir -p $OUT/c1
{ git log --oneline -1; nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; python -c "import torch,triton,sys;print(torch.__version__, torch.version.cuda, triton.__version__, sys.version.split()[0])"; } > $OUT/c1/versions.txt 2>&1
git diff HEAD > $OUT/c1/tree.diff
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 330 python -m benchmarks.harness.bench_wgrad --sweep --shapes mixtral-step --rounds 5 --iters 5 > $OUT/c1/bench_wgrad.log 2>&1; echo "bench_wgrad rc=$?"
grep -E "left out|^\|" $OUT/c1/bench_wgrad.log
for r in 1 2 3; do
  timeout 60 python -m benchmarks.harness.bench_gemm_shapes --logit-variants --out $OUT/c1/logit_r$r.json > $OUT/c1/logit_r$r.log 2>&1; echo "logit round $r rc=$?"
done
grep "^|" $OUT/c1/logit_r1.log | head -3; for r in 1 2 3; do grep "^|" $OUT/c1/logit_r$r.log | grep -E "152064|50304" | head -30; done
cd $OUT && tar czf s71_call1.tgz c1 && rm -rf c1
