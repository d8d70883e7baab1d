#!/bin/bash
# Session 72, call 2 (one H200): the step with the grad norm's squares kernel, the norm read with
# the step's figures (one host read), no device sync between steps (pinned batches copied without
# blocking) and the flat AdamW at 1024 values x 4 warps: the one-GPU GPU tests (bits of the CLI
# runs across schedules and graphs), the flat AdamW's block x warps again in another order, then
# the Mixtral-like shape beside torchtitan compiled (3 interleaved rounds and the profiled run).
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/c2
{ git log --oneline -1; nvidia-smi -L; python -c "import torch,triton,sys;print(torch.__version__, torch.version.cuda, triton.__version__, sys.version.split()[0])"; } > $OUT/c2/versions.txt 2>&1
git diff HEAD > $OUT/c2/tree.diff
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 240 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m "gpu and not multigpu" tests/training/test_gpu.py tests/training/test_optim.py tests/kernels/test_square_sums.py tests/kernels/test_adamw.py > $OUT/c2/tests.log 2>&1; echo "tests rc=$?"; tail -4 $OUT/c2/tests.log
timeout 150 python -m benchmarks.harness.bench_optim --preset mixtral-1gpu-proxy --flat-configs 1024x4,4096x8,512x4,2048x4,1024x2,1024x4,4096x8 --rounds 5 --iters 3 > $OUT/c2/bench_optim.log 2>&1; echo "bench_optim rc=$?"
grep -E "^\| flat|^\| square|^\| _foreach" $OUT/c2/bench_optim.log
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks.mem,temperature.gpu,clocks_event_reasons.active --format=csv -lms 500 > $OUT/c2/smi.csv 2>&1 &
SMI=$!
python -m benchmarks.gpu.run peer_titan_1gpu_mixtral_compiled --out $OUT/c2 --no-install --time-limit 300 2>&1 | tail -4
kill $SMI
tar xzf $OUT/c2/peer_titan_1gpu_mixtral_compiled.tgz -C /tmp 2>/dev/null; cat /tmp/peer_titan_1gpu_mixtral_compiled/summary.md 2>/dev/null | tail -8
cd $OUT && tar czf s72_call2.tgz c2 && rm -rf c2
