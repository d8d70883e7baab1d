#!/bin/bash
# Session 71, call 3 (one H200): the weight-grad kernel's GPU tests (every form's bits, graph
# capture, no sync) and the grad-placement tests; the short list of tile configs in 7 rounds at
# every step shape; then the Qwen3 proxy beside torchtitan compiled (3 interleaved rounds and the
# profiled run) with the new few-rows tiles.
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/c3
{ git log --oneline -1; nvidia-smi -L; python -c "import torch,triton,sys;print(torch.__version__, torch.version.cuda, triton.__version__, sys.version.split()[0])"; } > $OUT/c3/versions.txt 2>&1
git diff HEAD > $OUT/c3/tree.diff
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m gpu tests/kernels/test_grouped_wgrad.py tests/training/test_grad_placement.py tests/training/test_expert_grad_placement.py > $OUT/c3/tests.log 2>&1; echo "tests rc=$?"; tail -4 $OUT/c3/tests.log
timeout 150 python -m benchmarks.harness.bench_wgrad --candidates --shapes mixtral-step --rounds 7 --iters 5 > $OUT/c3/bench_wgrad.log 2>&1; echo "bench_wgrad rc=$?"
grep -E "left out" $OUT/c3/bench_wgrad.log
grep -E "^\|" $OUT/c3/bench_wgrad.log | awk -F'|' '{printf "%s|%s|%s|%s|%s\n", substr($2,1,22), $3, $4, $5, $9}'
python -m benchmarks.gpu.run peer_titan_1gpu_qwen3_compiled --out $OUT/c3 --time-limit 330 2>&1 | tail -6
cd $OUT && tar czf s71_call3.tgz c3 && rm -rf c3
