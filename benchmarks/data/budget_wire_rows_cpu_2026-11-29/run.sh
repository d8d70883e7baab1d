#!/bin/sh
# The fitted budget's wire rows over the dropless exact rows, per step, on CPU ranks (gloo).
# usage: run.sh TREE OUT NPROC ROUTING TOPK   (ROUTING: forced or learned; TREE: the source tree)
# One run of the main job's command (epoverlap-launch: --preset tiny, the Python stdlib source
# as data) with 32 experts, the budget dispatch at the auto default's 1.25, fitted to the demand.
set -e
tree=$1 out=$2 nproc=$3 routing=$4 topk=$5
name="${routing}_top${topk}_ep${nproc}"
extra=""
[ "$routing" = learned ] || extra="--moe-router-force-load-balancing"
cd "$tree"
PYTHONPATH="$tree" python -m epoverlap.cli.launch --nproc "$nproc" --num-experts 32 \
    --moe-router-topk "$topk" --moe-dispatch-budget 1.25 --moe-dispatch-budget-fit \
    --train-iters 40 --log-json "$out/$name.jsonl" $extra > "$out/$name.log" 2>&1
