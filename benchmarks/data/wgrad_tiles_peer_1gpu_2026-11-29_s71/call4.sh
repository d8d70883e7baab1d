#!/bin/bash
# Session 71, call 4 (one H200): the weight-grad kernel's GPU tests on the final tree (after the
# TMA and flattened forms were dropped), then the Mixtral-like and DeepSeek-like shapes beside
# torchtitan compiled (3 interleaved rounds each and the profiled runs) with the new tiles.
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/c4
{ git log --oneline -1; nvidia-smi -L; python -c "import torch,triton,sys;print(torch.__version__, torch.version.cuda, triton.__version__, sys.version.split()[0])"; } > $OUT/c4/versions.txt 2>&1
git diff HEAD > $OUT/c4/tree.diff
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 80 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m gpu tests/kernels/test_grouped_wgrad.py > $OUT/c4/tests.log 2>&1; echo "tests rc=$?"; tail -2 $OUT/c4/tests.log
python -m benchmarks.gpu.run peer_titan_1gpu_mixtral_compiled peer_titan_1gpu_dsv3_compiled --out $OUT/c4 --no-install --time-limit 560 2>&1 | tail -6
for s in mixtral dsv3; do tar xzf $OUT/c4/peer_titan_1gpu_${s}_compiled.tgz -C /tmp 2>/dev/null; cat /tmp/peer_titan_1gpu_${s}_compiled/summary.md 2>/dev/null | tail -8; done
cd $OUT && tar czf s71_call4.tgz c4 && rm -rf c4
