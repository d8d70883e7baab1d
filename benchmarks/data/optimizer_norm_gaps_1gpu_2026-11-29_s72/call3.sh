#!/bin/bash
# Session 72, call 3 (one H200): call 2's peer step again, .titan carried this time: the
# Mixtral-like shape beside torchtitan compiled (3 interleaved rounds and the profiled run), the
# GPU's power and clocks sampled every 500 ms.
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/c3
{ git log --oneline -1; nvidia-smi -L; python -c "import torch,triton,sys;print(torch.__version__, torch.version.cuda, triton.__version__, sys.version.split()[0])"; } > $OUT/c3/versions.txt 2>&1
git diff HEAD > $OUT/c3/tree.diff
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks.mem,temperature.gpu,clocks_event_reasons.active --format=csv -lms 500 > $OUT/c3/smi.csv 2>&1 &
SMI=$!
python -m benchmarks.gpu.run peer_titan_1gpu_mixtral_compiled --out $OUT/c3 --time-limit 330 2>&1 | tail -4
kill $SMI
tar xzf $OUT/c3/peer_titan_1gpu_mixtral_compiled.tgz -C /tmp 2>/dev/null; cat /tmp/peer_titan_1gpu_mixtral_compiled/summary.md 2>/dev/null | tail -8
cd $OUT && tar czf s72_call3.tgz c3 && rm -rf c3
