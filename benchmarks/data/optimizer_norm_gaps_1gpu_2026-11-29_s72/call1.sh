#!/bin/bash
# Session 72, call 1 (one H200): the grad norm's new squares kernel and the flat AdamW's block x
# warps at the Mixtral-like shape (bench_optim), the GPU tests they touch, then one Mixtral-like
# training run of 30 steps (the peer command) profiled at steps 20-21 with its trace kept, and
# the GPU's power and clocks sampled every 200 ms throughout (where the step's host gaps go).
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/c1
{ git log --oneline -1; nvidia-smi -L; python -c "import torch,triton,sys;print(torch.__version__, torch.version.cuda, triton.__version__, sys.version.split()[0])"; } > $OUT/c1/versions.txt 2>&1
git diff HEAD > $OUT/c1/tree.diff
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m gpu tests/kernels/test_square_sums.py tests/training/test_optim.py tests/kernels/test_adamw.py > $OUT/c1/tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/c1/tests.log
nvidia-smi --help-query-gpu | grep -i -E "reasons.active|power.draw |clocks.sm" | head -5 > $OUT/c1/smi_fields.txt
timeout 200 python -m benchmarks.harness.bench_optim --preset mixtral-1gpu-proxy --flat-configs 4096x8,2048x4,4096x4,8192x8,8192x16,16384x16,1024x4 --rounds 5 --iters 3 > $OUT/c1/bench_optim.log 2>&1; echo "bench_optim rc=$?"
grep -E "^\|" $OUT/c1/bench_optim.log
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks.mem,temperature.gpu,clocks_event_reasons.active --format=csv -lms 200 > $OUT/c1/smi.csv 2>&1 &
SMI=$!
rm -rf /tmp/prof
timeout 200 torchrun --nproc-per-node 1 -m epoverlap.train --preset mixtral-1gpu-proxy --micro-batch-size 1 --num-microbatches 2 --moe-router-force-load-balancing --train-iters 30 --log-interval 1 --log-json $OUT/c1/run.jsonl --profile-steps 20:21 --profile-dir /tmp/prof --use-pytorch-profiler > $OUT/c1/run.log 2>&1; echo "run rc=$?"
kill $SMI
grep -E "^path|^done" $OUT/c1/run.log
ls -la /tmp/prof | head
for f in /tmp/prof/*.json; do gzip -c "$f" > $OUT/$(basename $f).gz; done; ls -la $OUT
ls -la $OUT/c1
cd $OUT && tar czf s72_call1.tgz c1 && rm -rf c1
