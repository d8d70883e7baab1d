#!/bin/bash
# Session 73, call 5 (one H200): the experts' weight-grad kernel at more rows a step (BLOCK_K 128
# and 32, more stages) and 256 x 128 tiles against the default, at every one-GPU proxy's step
# shapes (bench_wgrad --configs, 5 rounds of 10 calls); then the kernel's GPU tests, whose
# tile-config test now holds 128 and 32 rows a step (the same bits asked).
set -u
export PYTHONUNBUFFERED=1
C=$OUT/c5; mkdir -p $C
{ git log --oneline -1; nvidia-smi -L; python -c "import torch,triton,sys;print(torch.__version__, torch.version.cuda, triton.__version__, sys.version.split()[0])"; } > $C/versions.txt 2>&1
git diff HEAD > $C/tree.diff
pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
timeout 120 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m "gpu and not multigpu" tests/kernels/test_grouped_wgrad.py > $C/tests_wgrad.log 2>&1
echo "tests rc=$?"; tail -3 $C/tests_wgrad.log
timeout 300 python -m benchmarks.harness.bench_wgrad --rounds 5 --iters 10 --shapes mixtral-step --configs 128x256x128/w8/s2/g8,256x128x128/w8/s2/g8,256x128x64/w8/s4/g8,256x128x64/w8/s3/g8,128x256x32/w8/s6/g8,128x256x32/w8/s7/g8,128x128x128/w4/s2/g8 > $C/bench_wgrad.md 2>&1
echo "bench rc=$?"; grep "^|" $C/bench_wgrad.md
