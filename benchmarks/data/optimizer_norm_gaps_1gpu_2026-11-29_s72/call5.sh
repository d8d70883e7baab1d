#!/bin/bash
# Session 72, call 5 (one H200), given inline to the device tool (kept here as it ran): the GPU
# tests call 2 did not reach before its 240 s limit: the squares kernel, the optimizer and the
# flat AdamW, then the one-GPU CLI runs' bit checks of tests/training/test_gpu.py (graphed
# against eager, the fused loss, the fill of new memory under each graph scope, bf16 training).
mkdir -p $OUT/c5; git diff HEAD > $OUT/c5/tree.diff; git log --oneline -1 > $OUT/c5/versions.txt; pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; export PYTHONUNBUFFERED=1; timeout 100 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m "gpu and not multigpu" tests/kernels/test_square_sums.py tests/training/test_optim.py tests/kernels/test_adamw.py > $OUT/c5/tests_fast.log 2>&1; echo "fast rc=$?"; tail -2 $OUT/c5/tests_fast.log; timeout 280 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m "gpu and not multigpu" --durations=0 tests/training/test_gpu.py -k "cli or graphed or deterministic or bf16" > $OUT/c5/tests_gpu.log 2>&1; echo "gpu rc=$?"; tail -25 $OUT/c5/tests_gpu.log
