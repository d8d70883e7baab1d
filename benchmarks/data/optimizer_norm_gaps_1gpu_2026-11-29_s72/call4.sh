#!/bin/bash
# Session 72, call 4 (one H200): the Qwen3 proxy and the DeepSeek-like shape with the same tree:
# each beside torchtitan compiled (3 interleaved rounds and the profiled run), the
# GPU's power and clocks sampled every 500 ms.
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/c4
{ git log --oneline -1; nvidia-smi -L; python -c "import torch,triton,sys;print(torch.__version__, torch.version.cuda, triton.__version__, sys.version.split()[0])"; } > $OUT/c4/versions.txt 2>&1
git diff HEAD > $OUT/c4/tree.diff
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks.mem,temperature.gpu,clocks_event_reasons.active --format=csv -lms 500 > $OUT/c4/smi.csv 2>&1 &
SMI=$!
python -m benchmarks.gpu.run peer_titan_1gpu_qwen3_compiled peer_titan_1gpu_dsv3_compiled --out $OUT/c4 --time-limit 540 2>&1 | tail -4
kill $SMI
for s in qwen3 dsv3; do tar xzf $OUT/c4/peer_titan_1gpu_${s}_compiled.tgz -C /tmp 2>/dev/null; cat /tmp/peer_titan_1gpu_${s}_compiled/summary.md 2>/dev/null | tail -8; done
cd $OUT && tar czf s72_call3.tgz c4 && rm -rf c4
