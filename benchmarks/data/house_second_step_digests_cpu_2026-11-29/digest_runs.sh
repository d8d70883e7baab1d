#!/bin/bash
# usage: digest_runs.sh TREE OUTDIR
set -u
cd $1; export PYTHONPATH=$1; mkdir -p $2
timeout 900 python -m epoverlap.cli.launch --log-json $2/main.jsonl > $2/main.log 2>&1; echo "main rc=$?" >> $2/rc
for mode in seq ovl; do
  extra=""; [ $mode = ovl ] && extra="--overlap-moe-expert-parallel-comm --delay-wgrad-compute"
  [ $mode = seq ] && extra="--no-overlap-moe-expert-parallel-comm"
  timeout 600 python -m torch.distributed.run --standalone --nproc-per-node 2 -m epoverlap.train --preset tiny --mock-data --expert-model-parallel-size 2 --train-iters 6 --log-interval 1 --tune off $extra --log-json $2/ep2_$mode.jsonl > $2/ep2_$mode.log 2>&1; echo "ep2_$mode rc=$?" >> $2/rc
done
