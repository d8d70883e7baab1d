#!/usr/bin/env bash
# All GPU checks and timings of the project in one device call, by part:
#   benchmarks/harness/gpu_suite.sh smoke     install, versions, a fast pass over every GPU path
#   benchmarks/harness/gpu_suite.sh all2      kernel tests + kernel benchmark (tile sweep) + baseline throughput
#   benchmarks/harness/gpu_suite.sh kernels   kernel GPU tests + kernel benchmark
#   benchmarks/harness/gpu_suite.sh train     GPU pytest tier (1 and N GPUs) + baseline training throughput
#   benchmarks/harness/gpu_suite.sh overlap   overlap benchmark on NGPUS (default 2) GPUs, with spans
#   benchmarks/harness/gpu_suite.sh trace     one shape, spans of every mode + torch.profiler traces
#   benchmarks/harness/gpu_suite.sh scale     bitwise check + overlap benchmark on all visible GPUs
#   benchmarks/harness/gpu_suite.sh verify    GPU pytest tier (graphs on one GPU first, then the CLI bitwise
#                                runs on 2 GPUs over EPOVERLAP_GPU_STEPS steps) + kernel tests
#   benchmarks/harness/gpu_suite.sh merged1   one GPU: every `gpu` (not `multigpu`) pytest test, bench_host
#                                with the sync-free modes and the eager per-node host table
#   benchmarks/harness/gpu_suite.sh one       one GPU: graphs/streams GPU tests, kernel tests, host cost
#                                eager vs graphed, 200-step small-preset runs (graphed, with and
#                                without --deterministic-mode), the same command twice
#   benchmarks/harness/gpu_suite.sh tests1    the one-GPU pytest tier alone
#   benchmarks/harness/gpu_suite.sh one2      one GPU: the tier again, 1000 graphed steps (memory), a graphed
#                                step's timeline, resume bitwise with graphs, checkpoint times
#   benchmarks/harness/gpu_suite.sh pipeline  pipeline GPU tests (PP=2 bitwise vs one GPU; PP=2 x EP=2 on 4)
#                                + pipeline benchmark (bubble measured vs analytic, overlap
#                                on/off, PP=NGPUS against EP=NGPUS)
#   benchmarks/harness/gpu_suite.sh launch1   one GPU: the Triton launch cache (issue 14): kernel GPU tests
#                                (bitwise against Triton's own launch path), the one-GPU tier,
#                                host cost per step and per node with and without it, per-call
#                                host time of every kernel op
#   benchmarks/harness/gpu_suite.sh host1     one GPU: host time of one op call piece by piece
#                                (bench_launch), per node, and the call sites of fills/copies
#   benchmarks/harness/gpu_suite.sh a2a1      one GPU: host time of one EP all-to-all call piece by piece
#                                (bench_a2a_host: backend, dist, the watch, autograd)
#   benchmarks/harness/gpu_suite.sh sched1    one GPU: host cost of the overlap schedule itself (bench_host
#                                --schedule-ab: sequential vs combined 1F1B at EP 1), TESTS first
#   benchmarks/harness/gpu_suite.sh pin1      one GPU: sched1's A/B with the process on all CPUs and on the
#                                CPU lists of PIN_SETS (thread hand-over cost vs the schedule's)
#   benchmarks/harness/gpu_suite.sh det1      one GPU: the price of --deterministic-mode with and without
#                                torch's fill of new memory (bench_determinism: eager and
#                                graphed, DET_AB_ROUNDS in-process rounds alternated step by
#                                step, DET_OPS ops whose host time grows; DET_CLI_ROUNDS of
#                                training-command runs of DET_STEPS steps, their bits), TESTS
#                                (pytest files or ids) first
#   benchmarks/harness/gpu_suite.sh optim1    one GPU: the AdamW forms (bench_optim at OPTIM_PRESETS), TESTS
#                                (pytest files or ids) first
#   benchmarks/harness/gpu_suite.sh loss1     one GPU: the fused cross-entropy against the torch loss it
#                                replaced (bench_loss at LOSS_SHAPES: the op and the model's
#                                loss node, host, GPU, launches, peak memory), TESTS first
#   benchmarks/harness/gpu_suite.sh check1    one GPU: every op's kernel GPU tests + the one-GPU model tier
#   benchmarks/harness/gpu_suite.sh fusion1   one GPU: the aux-loss and gradient-accumulation fusions: GPU
#                                tests, the one-GPU tier, in-process A/B, the CLI run twice
#   benchmarks/harness/gpu_suite.sh accum1    one GPU: the gradient-accumulation fusion's step time at a
#                                GPU-bound shape, with/without, alternated; kernel tests first
#   benchmarks/harness/gpu_suite.sh contention 2 GPUs, issue 20: bench_contention with NCCL's kernels per CTA
#                                budget, the Megatron shapes' seq/ovl/ovl_wgrad with spans per
#                                budget and comm-stream priority, compute slowdown per node kind
#                                (epoverlap-timeline --compare), NVLink and NCCL_P2P_DISABLE=1
#   benchmarks/harness/gpu_suite.sh runs      200-step main-job and small-preset runs (stalls, imbalance, the
#                                price of --deterministic) + overlap benchmark with graphs,
#                                NVLink and NCCL_P2P_DISABLE=1
#   benchmarks/harness/gpu_suite.sh x2tests   2 GPUs: the multigpu CLI tests (bitwise under --deterministic-mode),
#                                resume and a killed rank
#   benchmarks/harness/gpu_suite.sh x2bench   2 GPUs: every overlap mode eager and graphed with T_comp/T_comm,
#                                NVLink (spans of the Megatron shapes) and NCCL_P2P_DISABLE=1
#   benchmarks/harness/gpu_suite.sh x2more    2 GPUs: Megatron-core beside us, the sync-free CLI test, 200-step
#                                runs with/without --deterministic-mode, the PP=2 test
#   benchmarks/harness/gpu_suite.sh x2last    2 GPUs: NCCL CTA budgets vs compute slowdown, router balance per
#                                setting (1 GPU each), the simulator test with its spans kept
#   benchmarks/harness/gpu_suite.sh x2ab      2 GPUs: TESTS (pytest files), then this tree's eager overlap
#                                against .baseline/'s (an earlier commit), alternated, NVLink
#                                and NCCL_P2P_DISABLE=1 (BENCH_ARGS: more bench_overlap options,
#                                e.g. --rounds 2; AFTER_ARGS: options for this tree's side only)
#   benchmarks/harness/gpu_suite.sh cliab     NGPUS GPUs: the training command of this tree against
#                                .baseline/'s, alternated (CLI_ROUNDS, CLI_ITERS steps of
#                                --preset megatron-cmp --mock-data and CLI_FLAGS, default --bf16):
#                                median step time after the warm-up, per side
#   benchmarks/harness/gpu_suite.sh x2probe   2 GPUs: the overlap probe in the training command at the
#                                Megatron shapes, both regimes, with and without delayed wgrad
#   benchmarks/harness/gpu_suite.sh x2prof    2 GPUs: host time per node action and a cProfile per mode
#   benchmarks/harness/gpu_suite.sh x2green   2 GPUs: the GEMMs on a CUDA green context of fewer SMs beside
#                                NCCL's all-to-all (bench_contention --compute-sms)
#   benchmarks/harness/gpu_suite.sh x2nccl    2 GPUs: NCCL settings (chunk, buffer sizes) of the host-memory
#                                all-to-all: its speed beside the GEMMs, and the step with them
#   benchmarks/harness/gpu_suite.sh x2carve   2 GPUs: the grouped GEMMs' SM carveout and the paired-ends plan
#                                (VARIANTS; BENCH_ARGS: more bench_overlap options)
#   benchmarks/harness/gpu_suite.sh x2once    2 GPUs: --moe-dispatch-once-per-rank's tests (TESTS), then
#                                Megatron-core beside us with it, host-memory links and NVLink
#   benchmarks/harness/gpu_suite.sh clipeer   NGPUS GPUs: the training command's step against bench_peer's
#                                epoverlap side at the same shape, one host
#   benchmarks/harness/gpu_suite.sh peer      Megatron-core beside us (benchmarks/harness/bench_peer.py) on NGPUS GPUs and
#                                its GPU tests; needs megatron-core importable (the peer extra)
# Everything is written under ${OUT:-runs/gpu} (logs, JSON, span files, one tarball) and the
# short tables are printed last. Multicast stays off (see KINDS.md).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PART=${1:-smoke}
OUTDIR=${OUT:-runs/gpu}
WORK=/tmp/epoverlap-gpu
rm -rf "$WORK"  # a warm machine keeps the last call's files, which came back already
mkdir -p "$OUTDIR" "$WORK"
NGPUS=${NGPUS:-2}
ALL_GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
SUMMARY="$WORK/summary.txt"
: > "$SUMMARY"

versions() {
  python3 - <<'EOF'
import torch, triton, datetime, platform
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
print(f"date {datetime.date.today()} | torch {torch.__version__} | triton {triton.__version__} "
      f"| nccl {nccl} | python {platform.python_version()} | "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")
EOF
}

TWO_GPUS=$(python3 -c "print(','.join(str(i) for i in range(min($ALL_GPUS, $NGPUS))))")

# DEADLINE (s since the suite started, 0 = none): steps that would start past it are skipped
# and each step's limit is cut to what is left, so one device call ends inside its own limit.
DEADLINE=${DEADLINE:-0}
step() {  # step NAME CMD... : run (bounded by STEP_TIMEOUT s), log, record the exit code
  local name=$1; shift
  local start=$SECONDS limit=${STEP_TIMEOUT:-580}
  if [ "$DEADLINE" -gt 0 ]; then
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 20 ]; then echo "$name: skipped (deadline)" | tee -a "$SUMMARY"; return; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$WORK/$name.log"
  echo "$name: rc=$rc ($((SECONDS - start)) s)" | tee -a "$SUMMARY"
}

env_set() {  # env_set ENTRY: ENTRY is tag or tag:VAR=val,VAR=val; sets SET_TAG and SET_ENVS
  local assigns
  IFS=: read -r SET_TAG assigns <<< "$1"
  SET_ENVS=()
  [ -n "$assigns" ] && IFS=, read -ra SET_ENVS <<< "$assigns"
  return 0
}

tests_first() {  # tests_first NAME LIMIT: a 2-GPU part's TESTS (pytest args), if given, first,
                 # bounded by TEST_TIMEOUT or LIMIT s
  [ -n "${TESTS:-}" ] || return 0
  CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=${TEST_TIMEOUT:-$2} step "$1" \
    python3 -m pytest $TESTS -q -p no:cacheprovider --durations=8
}

small_200_pair() {  # the small preset on NGPUS GPUs, overlap + delayed wgrad + partial graphs,
                    # 200 steps, without and with --deterministic-mode (stalls, balance, price)
  local run="torchrun --standalone --nproc-per-node=$NGPUS -m epoverlap.train --preset small \
    --bf16 --expert-model-parallel-size $NGPUS --train-iters 200 --log-interval 50 \
    --overlap-moe-expert-parallel-comm --delay-wgrad-compute --cuda-graph-impl local \
    --cuda-graph-modules attn moe_router moe_preprocess"
  mkdir -p "$WORK/runs"
  CUDA_VISIBLE_DEVICES=$TWO_GPUS step small_200 $run --log-json "$WORK/runs/small_200.jsonl"
  CUDA_VISIBLE_DEVICES=$TWO_GPUS step small_200_det $run --deterministic-mode \
    --log-json "$WORK/runs/small_200_det.jsonl"
}

pip install -q --no-deps --no-build-isolation -e . > "$WORK/install.log" 2>&1 || cat "$WORK/install.log"
# The import names epoverlap.kernels / epoverlap_tools map to kernels/ and tools/; make them
# importable even where the editable install's path hook is not picked up.
import_names() {  # import_names TREE DIR: DIR/epoverlap.kernels, DIR/epoverlap_tools -> TREE's
  mkdir -p "$2"
  ln -sfn "$1/kernels" "$2/epoverlap.kernels"
  ln -sfn "$1/tools" "$2/epoverlap_tools"
}
import_names "$PWD" "$WORK/path"
export PYTHONPATH="$PWD:$WORK/path${PYTHONPATH:+:$PYTHONPATH}"
# Wheels carried to the device (the peer part's megatron-core: it has no network), from a
# folder .whl/ of the checkout that git ignores, made here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
# and named in the device call's carry list.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$WORK/site" .whl/*.whl > "$WORK/wheels.log" 2>&1 || cat "$WORK/wheels.log"
  export PYTHONPATH="$WORK/site:$PYTHONPATH"
fi
versions | tee "$WORK/versions.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader >> "$WORK/versions.txt" 2>&1

case "$PART" in
  smoke)
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=200 step gpu_tests python3 -m pytest tests/test_gpu.py -q -x
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=120 step bench_overlap_quick torchrun --standalone \
      --nproc-per-node="$NGPUS" benchmarks/harness/bench_overlap.py --shapes quick,ratio_h4096_k8_f256 \
      --profile-shapes quick --out-dir "$WORK/bench_quick" --iters 3 --warmup 1
    STEP_TIMEOUT=150 step kernel_tests python3 -m pytest tests/kernels -m gpu -q -x
    STEP_TIMEOUT=100 step bench_kernels python3 benchmarks/harness/bench_kernels.py --out "$WORK/bench_kernels.md"
    ;;
  all2)  # kernel tests, kernel benchmark with the tile sweep, baseline training throughput
    STEP_TIMEOUT=200 step kernel_tests python3 -m pytest tests/kernels -m gpu -q
    STEP_TIMEOUT=150 step bench_kernels python3 benchmarks/harness/bench_kernels.py --sweep --out "$WORK/bench_kernels.md"
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=160 step bench_train python3 benchmarks/harness/bench_train.py \
      --gpus "1,$NGPUS" --preset small --iters 30 --out "$WORK/bench_train.md"
    ;;
  kernels)
    step kernel_tests python3 -m pytest tests/kernels -m gpu -q
    step bench_kernels python3 benchmarks/harness/bench_kernels.py --out "$WORK/bench_kernels.md"
    ;;
  train)
    CUDA_VISIBLE_DEVICES=$TWO_GPUS step gpu_tests python3 -m pytest tests/test_gpu.py -q
    step bench_train python3 benchmarks/harness/bench_train.py --gpus "1,$NGPUS" --preset small --iters 20 \
      --out "$WORK/bench_train.md"
    ;;
  overlap)
    CUDA_VISIBLE_DEVICES=$TWO_GPUS step bench_overlap torchrun --standalone --nproc-per-node="$NGPUS" -m benchmarks.harness.bench_overlap \
      --shapes "${SHAPES:-ratio_h2048_k8_f128,ratio_h2048_k8_f256,ratio_h4096_k8_f256,megatron_e32_k4_mbs2x8,megatron_e32_k4_mbs8x4,megatron_e8_k8_f4096_mbs8x4,dsv3_layer}" \
      --profile-shapes "${PROFILE:-ratio_h2048_k8_f128,ratio_h2048_k8_f256}" --out-dir "$WORK/bench_overlap" \
      --iters "${ITERS:-6}" --profile-steps "${PROFILE_STEPS:-4}"
    ;;
  scale)
    step bitwise torchrun --standalone --nproc-per-node="$ALL_GPUS" -m benchmarks.harness.check_bitwise --steps 20 \
      --out "$WORK/bitwise.json"
    step bench_overlap torchrun --standalone --nproc-per-node="$ALL_GPUS" -m benchmarks.harness.bench_overlap \
      --shapes "${SHAPES:-ratio_h2048_k8_f128,ratio_h2048_k8_f256,ratio_h4096_k8_f256,megatron_e32_k4_mbs2x8,megatron_e32_k4_mbs8x4,megatron_e8_k8_f4096_mbs8x4,dsv3_layer}" \
      --profile-shapes "${PROFILE:-ratio_h2048_k8_f128}" --out-dir "$WORK/bench_overlap" --iters 4
    ;;
  trace)  # spans of every mode + torch.profiler kernel traces of one shape, 2 GPUs
    CUDA_VISIBLE_DEVICES=$TWO_GPUS step bench_overlap torchrun --standalone --nproc-per-node="$NGPUS" \
      benchmarks/harness/bench_overlap.py --shapes "${SHAPES:-ratio_h2048_k8_f128}" \
      --profile-shapes "${SHAPES:-ratio_h2048_k8_f128}" --torch-trace --out-dir "$WORK/bench_overlap" --iters 6
    ;;
  verify)
    export EPOVERLAP_GPU_LOGS="$WORK/cli_logs" EPOVERLAP_GPU_STEPS=${EPOVERLAP_GPU_STEPS:-50}
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=420 step gpu_tests python3 -m pytest \
      tests/test_gpu.py -q -x -k "one_gpu or cli_runs or streams" --durations=8
    STEP_TIMEOUT=150 step kernel_tests python3 -m pytest tests/kernels -m gpu -q -x
    ;;
  pipeline)
    STEP_TIMEOUT=420 step pipeline_tests python3 -m pytest tests/test_pipeline_gpu.py -q
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=400 step bench_pipeline python3 \
      benchmarks/harness/bench_pipeline.py --gpus "$NGPUS" --preset small --num-layers 8 --iters 12 \
      --out-dir "$WORK/bench_pipeline"
    ;;
  merged1)  # one GPU after the merges: every one-GPU pytest test, host cost incl. per node
    STEP_TIMEOUT=400 step gpu_tests_all python3 -m pytest tests -q -m "gpu and not multigpu" \
      -p no:cacheprovider --durations=8
    STEP_TIMEOUT=150 step bench_host python3 benchmarks/harness/bench_host.py --sync-free \
      --out "$WORK/bench_host.json"
    ;;
  launch1)  # one GPU: the per-shape Triton launch cache, checked and timed
    STEP_TIMEOUT=200 step kernel_tests python3 -m pytest tests/kernels -m gpu -q -p no:cacheprovider
    STEP_TIMEOUT=240 step gpu_tests python3 -m pytest tests/test_gpu.py tests/test_gpu_sync_free.py \
      -q -m "gpu and not multigpu" -p no:cacheprovider --durations=5
    STEP_TIMEOUT=150 step bench_host python3 benchmarks/harness/bench_host.py --out "$WORK/bench_host.json"
    STEP_TIMEOUT=150 step bench_kernels python3 benchmarks/harness/bench_kernels.py --rep-ms 50 \
      --out "$WORK/bench_kernels.md"
    ;;
  host1)  # one GPU: where the eager host time goes (issue 14): the pieces of one op call,
          # the per-node host table, and the call sites of fills and copies; with a tree of an
          # earlier commit in .baseline/ (ignored by git, named in the device call's carry:
          # `git archive COMMIT | tar x -C .baseline`), the same bench_host runs on it first,
          # on the same GPU and host, for a before/after
    [ -n "${AB_ONLY:-}" ] || STEP_TIMEOUT=120 step bench_launch python3 benchmarks/harness/bench_launch.py
    if [ -d .baseline/epoverlap ]; then  # AB_ROUNDS alternations of before / after
      rm -f "$WORK"/ab_*.json  # a warm machine keeps the last call's files
      PINNED=${PIN:+taskset -c $PIN}  # PIN=4-7: every side on the same cores (less noise)
      # the sides of a round: before (.baseline/), a second earlier tree in .variant/ (made the
      # same way) if there is one, after (this tree)
      SIDES="before:$PWD/.baseline"
      [ -d .variant/epoverlap ] && SIDES="$SIDES variant:$PWD/.variant"
      SIDES="$SIDES after:$PWD"
      for side in $SIDES; do import_names "${side#*:}" "$WORK/path_${side%%:*}"; done
      for round in $(seq "${AB_ROUNDS:-1}"); do
        for side in $SIDES; do
          name=${side%%:*} tree=${side#*:}
          PYTHONPATH="$tree:$WORK/path_$name" STEP_TIMEOUT=150 step ${name}_$round $PINNED \
            python3 "$tree/benchmarks/harness/bench_host.py" --no-triton-path --top-ops 1 \
            --out "$WORK/ab_${name}_$round.json"
        done
      done
      python3 - "$WORK" <<'PYEOF' | tee "$WORK/ab_table.md"
import glob, json, statistics, sys
work = sys.argv[1]
runs = {side: [json.load(open(f))["rows"] for f in sorted(glob.glob(f"{work}/ab_{side}_*.json"))]
        for side in ("before", "variant", "after")}
runs = {side: rows for side, rows in runs.items() if rows}
sides = list(runs)
def pick(side, mode, key, how):
    return how(r[mode][key] for r in runs[side])
print(f"\n| {len(runs['after'])} alternating runs each | " + " | ".join(sides)
      + " | after / before |\n|" + " --- |" * (len(sides) + 2))
for mode in ("eager", "graphed"):
    for key in ("cpu_ms", "wall_ms"):
        for how in (statistics.median, min):
            got = [pick(side, mode, key, how) for side in sides]
            print(f"| {mode} {key} per step, {how.__name__} | "
                  + " | ".join(f"{v:.2f}" for v in got) + f" | {got[-1] / got[0]:.3f} |")
for side, rows in runs.items():
    print(f"{side} eager cpu_ms per run: {[round(r['eager']['cpu_ms'], 1) for r in rows]}; "
          f"graphed: {[round(r['graphed']['cpu_ms'], 1) for r in rows]}")
print("\n| eager node action, host us per call (median) | " + " | ".join(sides)
      + " | after / before |\n|" + " --- |" * (len(sides) + 2))
for node in runs["after"][0]["eager"]["nodes"]:
    got = [statistics.median(r["eager"]["nodes"][node][1] for r in runs[side]) for side in sides]
    print(f"| {node} | " + " | ".join(f"{v:.0f}" for v in got) + f" | {got[-1] / got[0]:.3f} |")
losses = {side: {r["eager"]["loss"] for r in rows} for side, rows in runs.items()}
print(f"\neager loss before {sorted(losses['before'])} after {sorted(losses['after'])}")
PYEOF
    fi
    [ -n "${AB_ONLY:-}" ] || STEP_TIMEOUT=200 step bench_host python3 benchmarks/harness/bench_host.py --no-triton-path --call-sites \
      aten::fill_ aten::zero_ aten::zeros aten::full_like aten::copy_ aten::clone \
      aten::_local_scalar_dense aten::mm --out "$WORK/bench_host.json"
    ;;
  a2a1)  # one GPU: the host time of one EP all-to-all call, piece by piece (issue 14), NCCL
          # on a world of one rank; A2A_ROUNDS runs of each size (the host noise between runs)
    for round in $(seq "${A2A_ROUNDS:-2}"); do
      for size in "1024 512" "4096 2048"; do
        set -- $size
        STEP_TIMEOUT=120 step a2a_${1}x${2}_$round python3 benchmarks/harness/bench_a2a_host.py \
          --device cuda --rows "$1" --hidden "$2" --repeats 21
        grep "^|" "$WORK/a2a_${1}x${2}_$round.log" | sed "s/^/[$1x$2 run $round] /" >> "$SUMMARY"
      done
    done
    ;;
  sched1)  # one GPU: what the overlap schedule itself costs the host (issue 14): the
            # sequential step against the combined 1F1B (and with delayed wgrad) at EP 1, in
            # one process, alternated SCHED_ROUNDS times (SCHED_SIDES: a comma list of the
            # sides, the first the baseline; SCHED_ITERS steps per side and round, 10; EXTRA:
            # more training flags, one string); TESTS (pytest files) first if given;
            # SHARE_ITERS > 0: also bench_host --autograd-share; SHAPE (small, tiny) and
            # TRAINER_DEVICE=cpu (the same A/B on CPU trainers of this host, shape tiny)
    if [ -n "${TESTS:-}" ]; then
      EPOVERLAP_GPU_STEPS=${EPOVERLAP_GPU_STEPS:-20} STEP_TIMEOUT=420 step tests \
        python3 -m pytest -q -p no:cacheprovider $TESTS
    fi
    if [ "${SHARE_ITERS:-0}" -gt 0 ]; then  # each node's forward with and without autograd
      STEP_TIMEOUT=200 step autograd_share python3 benchmarks/harness/bench_host.py \
        --autograd-share "$SHARE_ITERS" ${EXTRA:+--extra "$EXTRA"}
      sed -n '/^bench_host --autograd-share/,$p' "$WORK/autograd_share.log" >> "$SUMMARY"
    fi
    if [ "${SCHED_ROUNDS:-5}" -gt 0 ]; then  # SCHED_ROUNDS=0: the tests only
      STEP_TIMEOUT=300 step schedule_ab python3 benchmarks/harness/bench_host.py \
        --schedule-ab "${SCHED_ROUNDS:-5}" --iters "${SCHED_ITERS:-10}" --top-ops "${TOP_OPS:-30}" \
        ${SCHED_SIDES:+--schedule-sides "$SCHED_SIDES"} ${EXTRA:+--extra "$EXTRA"} \
        ${SHAPE:+--shape "$SHAPE"} ${TRAINER_DEVICE:+--trainer-device "$TRAINER_DEVICE"} \
        --out "$WORK/schedule_ab.json"
      sed -n '/^bench_host --schedule-ab/,$p' "$WORK/schedule_ab.log" | head -75 >> "$SUMMARY"
    fi
    ;;
  det1)  # one GPU: the price of --deterministic-mode, with torch's fill of new memory and
         # without (benchmarks/determinism.md); TESTS first if given
    if [ -n "${TESTS:-}" ]; then
      STEP_TIMEOUT=${TESTS_TIMEOUT:-300} step tests python3 -m pytest -q -p no:cacheprovider $TESTS
    fi
    STEP_TIMEOUT=${DET_TIMEOUT:-400} step bench_determinism python3 benchmarks/harness/bench_determinism.py \
      --cli-rounds "${DET_CLI_ROUNDS:-1}" --steps "${DET_STEPS:-40}" \
      --ab-rounds "${DET_AB_ROUNDS:-20}" --ops "${DET_OPS:-0}"
    sed -n '/^host self ms of one eager step/,/^$/p' "$WORK/bench_determinism.log" | head -45 \
      >> "$SUMMARY"
    sed -n '/^bench_determinism in one process/,/^threads/p' "$WORK/bench_determinism.log" \
      >> "$SUMMARY"
    grep -E "det vs det_fill" "$WORK/bench_determinism.log" >> "$SUMMARY"
    sed -n '/^bench_determinism: /,$p' "$WORK/bench_determinism.log" >> "$SUMMARY"
    ;;
  optim1)  # one GPU: the optimizer step in each AdamW form (benchmarks/optimizer.md)
    if [ -n "${TESTS:-}" ]; then
      STEP_TIMEOUT=${TESTS_TIMEOUT:-300} step tests python3 -m pytest -q -p no:cacheprovider $TESTS
    fi
    for preset in ${OPTIM_PRESETS:-megatron-cmp small}; do
      STEP_TIMEOUT=200 step "bench_optim_$preset" python3 benchmarks/harness/bench_optim.py --preset "$preset" \
        --rounds "${OPTIM_ROUNDS:-10}" --iters "${OPTIM_ITERS:-5}"
      sed -n '/^bench_optim: /,$p' "$WORK/bench_optim_$preset.log" >> "$SUMMARY"
    done
    ;;
  loss1)  # one GPU: the fused cross-entropy (benchmarks/kernels.md); TESTS first if given
    if [ -n "${TESTS:-}" ]; then
      STEP_TIMEOUT=${TESTS_TIMEOUT:-300} step tests python3 -m pytest -q -p no:cacheprovider $TESTS
    fi
    STEP_TIMEOUT=${LOSS_TIMEOUT:-300} step bench_loss python3 benchmarks/harness/bench_loss.py \
      --shapes "${LOSS_SHAPES:-1024x257,4096x257,8192x32000,4096x151936}" \
      --rounds "${LOSS_ROUNDS:-10}" --iters "${LOSS_ITERS:-5}" \
      --python-profile "${LOSS_PROFILE:-0}"
    sed -n '/^bench_loss: .*medians/,$p' "$WORK/bench_loss.log" >> "$SUMMARY"
    ;;
  pin1)  # one GPU: the schedule A/B (sequential against the combined order, SCHED_SIDES) with
         # the process on every CPU and on each CPU list of PIN_SETS ("all" = no --cpus), to
         # tell a cost of handing work between threads on different CPUs from the schedule's own
    lscpu > "$WORK/lscpu.txt" 2>&1
    grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA node0)" "$WORK/lscpu.txt" >> "$SUMMARY"
    for cpus in ${PIN_SETS:-all 3 3,4}; do
      pin=(); [ "$cpus" != all ] && pin=(--cpus "$cpus")
      STEP_TIMEOUT=${PIN_STEP_S:-150} step "schedule_ab_cpus_${cpus//,/_}" python3 benchmarks/harness/bench_host.py \
        --schedule-ab "${SCHED_ROUNDS:-5}" --iters 10 --top-ops 0 \
        --schedule-sides "${SCHED_SIDES:-sequential,combined_1f1b_one_stream,combined_1f1b}" \
        "${pin[@]}" ${EXTRA:+--extra "$EXTRA"} \
        --out "$WORK/schedule_ab_cpus_${cpus//,/_}.json"
      { echo "--- cpus: $cpus"; sed -n '/^combined.* \/ /p;/^| eager node action/,/^| issue/p;/^threads/,/^$/p' \
          "$WORK/schedule_ab_cpus_${cpus//,/_}.log"; } >> "$SUMMARY"
    done
    ;;
  check1)  # one GPU, after a change to the op wrappers / model: every op's GPU kernel tests
           # (bitwise, grads, graphs, the launch cache) and the one-GPU model tier
    STEP_TIMEOUT=240 step kernel_tests python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/kernels/test_kernels_gpu.py tests/kernels/test_fused_elementwise.py \
      -k "not offsets_past_int32 and not out_of_bounds"
    STEP_TIMEOUT=300 step gpu_tests python3 -m pytest tests/test_gpu.py tests/test_gpu_sync_free.py \
      -q -m "gpu and not multigpu" -p no:cacheprovider --durations=5
    ;;
  fusion1)  # one GPU: the host-saving fusions (the Switch aux loss inside the router op, the
            # gradient-accumulation fusion): their GPU tests, the one-GPU model tier, the
            # in-process A/B (AB_ROUNDS alternations), and the small preset's CLI run twice
            # (bf16, --deterministic-mode): the same losses bit for bit
    STEP_TIMEOUT=150 step fusion_tests python3 -m pytest -q -p no:cacheprovider \
      tests/kernels/test_router_triton.py tests/test_grad_accumulation.py
    STEP_TIMEOUT=200 step gpu_tests python3 -m pytest tests/test_gpu.py tests/test_gpu_sync_free.py \
      -q -m "gpu and not multigpu" -p no:cacheprovider --durations=5
    STEP_TIMEOUT=150 step fusion_ab python3 benchmarks/harness/bench_host.py --fusion-ab "${AB_ROUNDS:-5}" \
      --iters 10 --out "$WORK/fusion_ab.json"
    T1="torchrun --standalone --nproc-per-node=1 -m epoverlap.train --preset small --bf16"
    mkdir -p "$WORK/runs"
    for name in small1_30_det_a small1_30_det_b; do
      STEP_TIMEOUT=60 step "$name" $T1 --train-iters 30 --log-interval 10 --deterministic-mode \
        --log-json "$WORK/runs/$name.jsonl"
    done
    step compare_det python3 -m epoverlap.cli.compare_losses "$WORK/runs/small1_30_det_a.jsonl" \
      "$WORK/runs/small1_30_det_b.jsonl"
    ;;
  accum1)  # one GPU: the gradient-accumulation fusion's GPU time at a GPU-bound shape (hidden
           # 4096, seq 4096; graphs on, as the main job runs): the CLI with and without
           # --no-gradient-accumulation-fusion, alternated AB_ROUNDS times, median step time of
           # steps 6-16; first the kernel tests of the kernels a change touched (KTESTS)
    STEP_TIMEOUT=200 step kernel_tests python3 -m pytest -q -p no:cacheprovider \
      ${KTESTS:-tests/kernels/test_router_triton.py tests/kernels/test_fused_elementwise.py}
    T1="torchrun --standalone --nproc-per-node=1 -m epoverlap.train --bf16 --mock-data"
    BIG="--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8
      --seq-length 4096 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 2048
      --moe-shared-expert-intermediate-size 4096 --micro-batch-size 1 --num-microbatches 4
      --moe-aux-loss-coeff 0.01 --train-iters 16 --log-interval 8"
    mkdir -p "$WORK/runs"
    for round in $(seq "${AB_ROUNDS:-2}"); do
      for side in fused:"" unfused:"--no-gradient-accumulation-fusion"; do
        name=${side%%:*}_$round
        STEP_TIMEOUT=120 step "accum_$name" $T1 $BIG ${side#*:} --log-json "$WORK/runs/accum_$name.jsonl"
      done
    done
    python3 - "$WORK/runs" <<'PYEOF' | tee "$WORK/accum_table.md"
import glob, json, statistics, sys
rows = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/accum_*.jsonl")):
    side = path.rsplit("/", 1)[1].split("_")[1]
    steps = [json.loads(line) for line in open(path)]
    rows.setdefault(side, []).append(statistics.median(s["step_time_s"] * 1e3 for s in steps[5:]))
print("| side | median step ms per run | median |\n| --- | --- | --- |")
for side, runs in rows.items():
    print(f"| {side} | {[round(r, 2) for r in runs]} | {statistics.median(runs):.2f} |")
if len(rows) == 2:
    print(f"fused / unfused: {statistics.median(rows['fused']) / statistics.median(rows['unfused']):.3f}x")
PYEOF
    ;;
  tests1)  # the one-GPU pytest tier alone
    STEP_TIMEOUT=300 step gpu_tests python3 -m pytest tests/test_gpu.py -q -m gpu --durations=8
    ;;
  one2)  # one GPU: the tier again, 1000 graphed steps (memory), a graphed step's timeline,
         # resume bitwise with graphs, checkpoint save/load time at the largest bench shape
    STEP_TIMEOUT=240 step gpu_tests python3 -m pytest tests/test_gpu.py -q -m gpu --durations=8
    T1="torchrun --standalone --nproc-per-node=1 -m epoverlap.train --bf16"
    G="--cuda-graph-impl local --cuda-graph-modules attn moe_router moe_preprocess"
    R="$WORK/runs"; mkdir -p "$R"
    STEP_TIMEOUT=150 step small1_1000_graphs $T1 --preset small $G --train-iters 1000 \
      --log-interval 250 --log-json "$R/small1_1000_graphs.jsonl"
    STEP_TIMEOUT=90 step small1_profiled $T1 --preset small $G --train-iters 8 \
      --profile-steps 6:7 --profile-dir "$WORK/spans_graphed"
    STEP_TIMEOUT=60 step timeline epoverlap-timeline "$WORK/spans_graphed" --out-dir "$WORK/timeline"
    STEP_TIMEOUT=90 step resume_full $T1 --preset small $G --deterministic-mode --train-iters 10 \
      --log-json "$R/resume_full.jsonl"
    # rank 0 dies as step 7 starts (test-only fault); torchrun restarts it, it resumes from step 5
    EPOVERLAP_TEST_FAULT=exit@7 STEP_TIMEOUT=150 step resume_restarted torchrun --standalone \
      --nproc-per-node=1 --max-restarts=1 -m epoverlap.train --bf16 --preset small $G \
      --deterministic-mode --train-iters 10 --save "$WORK/ckpt" --save-interval 5 \
      --load "$WORK/ckpt" --log-json "$R/resume_split.jsonl"
    step compare_resume python3 -m epoverlap.cli.compare_losses "$R/resume_full.jsonl" \
      "$R/resume_split.jsonl"
    MEGA="--preset megatron-cmp --num-experts 8 --moe-router-topk 8 --moe-ffn-hidden-size 4096 \
      --micro-batch-size 8 --num-microbatches 4 --mock-data"
    STEP_TIMEOUT=150 step ckpt_save $T1 $MEGA --train-iters 2 --save "$WORK/ckpt_big"
    STEP_TIMEOUT=150 step ckpt_load $T1 $MEGA --train-iters 3 --load "$WORK/ckpt_big"
    du -sh "$WORK/ckpt_big" | tee -a "$SUMMARY"
    rm -rf "$WORK/ckpt_big" "$WORK/ckpt"
    ;;
  one)
    STEP_TIMEOUT=240 step gpu_tests python3 -m pytest tests/test_gpu.py -q -x \
      -k "one_gpu or streams or partial" --durations=8
    STEP_TIMEOUT=150 step kernel_tests python3 -m pytest tests/kernels -m gpu -q -x
    STEP_TIMEOUT=90 step bench_host python3 benchmarks/harness/bench_host.py --out "$WORK/bench_host.json"
    T1="torchrun --standalone --nproc-per-node=1 -m epoverlap.train --preset small --bf16"
    G="--cuda-graph-impl local --cuda-graph-modules attn moe_router moe_preprocess"
    mkdir -p "$WORK/runs"
    for run in small1_200_graphs:"$G" small1_200_graphs_det:"$G --deterministic-mode" \
               small1_50_det_a:"--deterministic-mode" small1_50_det_b:"--deterministic-mode"; do
      name=${run%%:*}; extra=${run#*:}
      iters=200; case $name in *_50_*) iters=50;; esac
      STEP_TIMEOUT=100 step "$name" $T1 --train-iters $iters --log-interval 50 $extra \
        --log-json "$WORK/runs/$name.jsonl"
    done
    step compare_det python3 -m epoverlap.cli.compare_losses "$WORK/runs/small1_50_det_a.jsonl" \
      "$WORK/runs/small1_50_det_b.jsonl"
    ;;
  runs)
    mkdir -p "$WORK/runs"
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=120 step main_job_200 epoverlap-launch \
      --train-iters 200 --log-interval 50 --log-json "$WORK/runs/main_job_200.jsonl"
    STEP_TIMEOUT=150 small_200_pair
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=300 step bench_overlap torchrun --standalone \
      --nproc-per-node="$NGPUS" benchmarks/harness/bench_overlap.py --graphs --iters "${ITERS:-4}" \
      --shapes "${SHAPES:-ratio_h2048_k8_f128,megatron_e32_k4_mbs2x8,megatron_e8_k8_f4096_mbs8x4}" \
      --out-dir "$WORK/bench_overlap"
    NCCL_P2P_DISABLE=1 CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=240 step bench_overlap_nop2p \
      torchrun --standalone --nproc-per-node="$NGPUS" -m benchmarks.harness.bench_overlap --graphs \
      --iters "${ITERS:-4}" --shapes "${P2P_SHAPES:-ratio_h2048_k8_f128,ratio_h2048_k4_f4096,megatron_e32_k4_mbs2x8}" \
      --out-dir "$WORK/bench_overlap_nop2p"
    ;;
  contention)  # issue 20 on NGPUS GPUs: contention per load and budget, then the step
    MEG="megatron_e32_k4_mbs2x8,megatron_e8_k8_f4096_mbs8x4"
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=150 step bench_contention torchrun --standalone \
      --nproc-per-node="$NGPUS" benchmarks/harness/bench_contention.py --out-dir "$WORK/bench_contention"
    for prio in high normal; do
      CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=240 step "bench_overlap_ctas_$prio" torchrun \
        --standalone --nproc-per-node="$NGPUS" benchmarks/harness/bench_overlap.py --shapes "$MEG" \
        --profile-shapes "$MEG" --profile-steps 2 --iters 3 --max-ctas default,16,4 \
        --extra-flags "--comm-stream-priority $prio" --out-dir "$WORK/bench_overlap_$prio"
    done
    NCCL_P2P_DISABLE=1 CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=240 step bench_overlap_nop2p \
      torchrun --standalone --nproc-per-node="$NGPUS" -m benchmarks.harness.bench_overlap --shapes "$MEG" \
      --profile-shapes "$MEG" --profile-steps 2 --iters 3 --out-dir "$WORK/bench_overlap_nop2p"
    for dir in "$WORK"/bench_overlap_high/spans/*/; do
      shape=$(basename "$dir")
      [ -d "$dir/seq" ] && [ -d "$dir/ovl" ] && STEP_TIMEOUT=60 step "compare_$shape" \
        epoverlap-timeline --compare "$dir/seq" "$dir/ovl" --out-dir "$WORK/compare_$shape"
    done
    ;;
  peer)  # PEER_TESTS=0: the benchmark only; OURS_OVL_FLAGS: also our overlap with them
    [ "${PEER_TESTS:-1}" = 0 ] || CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=300 step \
      peer_tests python3 -m pytest tests/test_bench_peer.py -q -m "gpu or multigpu"
    CUDA_VISIBLE_DEVICES=$TWO_GPUS step bench_peer torchrun --standalone \
      --nproc-per-node="$NGPUS" benchmarks/harness/bench_peer.py --out-dir "$WORK/bench_peer" \
      --ours-ovl-flags="${OURS_OVL_FLAGS:-}" \
      --shapes "${SHAPES:-megatron_e32_k4_mbs2x8,megatron_e32_k4_mbs8x4,megatron_e8_k8_f4096_mbs8x4}"
    ;;
  x2once)  # 2 GPUs, --moe-dispatch-once-per-rank: TESTS first (pytest args), then
            # bench_peer at SHAPES in each of REGIMES ("nop2p nvlink"), our overlap run again
            # with ONCE_NOP2P_FLAGS / ONCE_NVLINK_FLAGS (default: once per rank, with the
            # slow-link levers where the all-to-all goes through host memory) and our
            # sequential step with ONCE_SEQ_FLAGS (default: once per rank)
    export EPOVERLAP_GPU_STEPS=${EPOVERLAP_GPU_STEPS:-8} EPOVERLAP_GPU_LOGS="$WORK/cli_logs"
    tests_first once_tests 300
    for regime in ${REGIMES:-nop2p nvlink}; do
      # an empty ONCE_*_FLAGS is kept empty (ONCE_SEQ_FLAGS="": no extra sequential run)
      p2p=""; flags=${ONCE_NVLINK_FLAGS---moe-dispatch-once-per-rank}
      if [ $regime = nop2p ]; then
        p2p="NCCL_P2P_DISABLE=1"
        flags=${ONCE_NOP2P_FLAGS---moe-dispatch-once-per-rank --moe-grouped-gemm-sm-carveout 8 \
--moe-a2a-nccl-max-ctas 8 --delay-wgrad-compute --overlap-plan combined_1f1b_paired_ends}
      fi
      # ONCE_ENV_SETS (as x2nccl's NCCL_SETS): the job again per NCCL setting, both systems
      # under it; the entry "base" (the default) adds nothing to the step's name
      for set in ${ONCE_ENV_SETS:-base}; do
        env_set "$set"; name="bench_peer_$regime"; [ "$SET_TAG" = base ] || name+="_$SET_TAG"
        CUDA_VISIBLE_DEVICES=$TWO_GPUS step "$name" env $p2p "${SET_ENVS[@]}" torchrun \
          --standalone --nproc-per-node="$NGPUS" benchmarks/harness/bench_peer.py --out-dir "$WORK/$name" \
          --ours-ovl-flags="$flags" --ours-seq-flags="${ONCE_SEQ_FLAGS---moe-dispatch-once-per-rank}" \
          --shapes "${SHAPES:-megatron_e8_k8_f4096_mbs8x4,megatron_e32_k4_mbs8x4}"
      done
    done
    ;;
  clipeer)  # NGPUS GPUs, one host: the training command's step (`--preset megatron-cmp
             # --mock-data --bf16`, sequential) against bench_peer's epoverlap side at the same
             # shape (megatron_e32_k4_mbs2x8: the same flags, its own prefetched batches, the
             # trainer's step called directly), CLI first and last: is the command's step the
             # trainer's?
    mkdir -p "$WORK/cli"
    for run in 1 2; do
      CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=120 step "cli_$run" torchrun --standalone \
        --nproc-per-node="$NGPUS" -m epoverlap.train --preset megatron-cmp --mock-data --bf16 \
        --expert-model-parallel-size "$NGPUS" --train-iters 12 --log-interval 100 \
        --log-json "$WORK/cli/seq_$run.jsonl"
      [ $run = 2 ] && break
      CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=150 step peer_ours torchrun --standalone \
        --nproc-per-node="$NGPUS" benchmarks/harness/bench_peer.py --systems epoverlap \
        --shapes megatron_e32_k4_mbs2x8 --out-dir "$WORK/peer"
    done
    python3 - "$WORK" <<'PYEOF' | tee -a "$SUMMARY"
import glob, json, statistics, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/cli/seq_*.jsonl")):
    times = [r["step_time_s"] * 1e3 for r in map(json.loads, open(f)) if r["step"] > 3]
    print(f"clipeer {f.split('/')[-1]}: median step {statistics.median(times):.1f} ms "
          f"(min {min(times):.1f}, max {max(times):.1f}, steps 4-12)")
for shape in json.load(open(f"{sys.argv[1]}/peer/bench_peer.json"))["results"]:
    for mode, run in shape["runs"]["epoverlap"].items():
        print(f"clipeer bench_peer {mode}: step {run['step_ms']:.1f} ms")
PYEOF
    ;;
  x2tests)  # 2 GPUs: the multigpu tests of the CLI path (the bitwise comparisons under
             # --deterministic-mode over EPOVERLAP_GPU_STEPS steps, overlap over NCCL, the
             # simulator's replay), then resume on two GPUs and a SIGKILLed rank
    export EPOVERLAP_GPU_LOGS="$WORK/cli_logs" EPOVERLAP_GPU_STEPS=${EPOVERLAP_GPU_STEPS:-50}
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=420 step gpu_multigpu python3 -m pytest \
      tests/test_gpu.py -q -m multigpu -p no:cacheprovider --durations=10
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=240 step resume_and_kill python3 -m pytest \
      tests/test_checkpoint_gpu.py tests/test_liveness.py -q -m multigpu -p no:cacheprovider \
      --durations=5
    ;;
  x2bench)  # 2 GPUs, issues 13/14/20: seq, ovl, ovl_wgrad and the compute-only run, eager and
            # graphed, T_comm replayed, at the ratio and Megatron shapes with spans of two
            # Megatron shapes (compute slowdown under the overlap); then NCCL_P2P_DISABLE=1
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=330 step bench_overlap torchrun --standalone \
      --nproc-per-node="$NGPUS" benchmarks/harness/bench_overlap.py --graphs --iters "${ITERS:-4}" \
      --shapes "${SHAPES:-ratio_h2048_k8_f128,ratio_h2048_k8_f256,megatron_e32_k4_mbs2x8,megatron_e32_k4_mbs8x4,megatron_e8_k8_f4096_mbs8x4}" \
      --profile-shapes "${PROFILE:-megatron_e32_k4_mbs2x8,megatron_e8_k8_f4096_mbs8x4}" \
      --profile-steps 2 --out-dir "$WORK/bench_overlap"
    NCCL_P2P_DISABLE=1 CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=300 step bench_overlap_nop2p \
      torchrun --standalone --nproc-per-node="$NGPUS" -m benchmarks.harness.bench_overlap --graphs \
      --iters "${P2P_ITERS:-3}" --warmup 1 \
      --shapes "${P2P_SHAPES:-ratio_h2048_k8_f128,ratio_h2048_k4_f4096,megatron_e32_k4_mbs2x8}" \
      --out-dir "$WORK/bench_overlap_nop2p"
    ;;
  x2more)  # 2 GPUs: Megatron-core beside us (needs the .whl carry), the sync-free CLI test,
           # 200-step small-preset runs with and without --deterministic-mode (the price, the
           # router's balance, no stalls), the pipeline's two-GPU test
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=240 step bench_peer torchrun --standalone \
      --nproc-per-node="$NGPUS" benchmarks/harness/bench_peer.py --out-dir "$WORK/bench_peer" --warmup 2 \
      --iters 4 --shapes "${SHAPES:-megatron_e32_k4_mbs2x8,megatron_e32_k4_mbs8x4,megatron_e8_k8_f4096_mbs8x4}"
    STEP_TIMEOUT=100 small_200_pair
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=200 step sync_free_multigpu python3 -m pytest \
      tests/test_gpu_sync_free.py -q -m multigpu -p no:cacheprovider --durations=5
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=120 step pipeline_pp2 python3 -m pytest \
      tests/test_pipeline_gpu.py -q -k pp2_over_nccl -p no:cacheprovider
    ;;
  x2last)  # 2 GPUs: the NCCL CTA budget against the compute slowdown under the overlap at two
           # Megatron shapes (issue 20), the router's balance at 200 steps per candidate setting
           # (one GPU each, side by side), the simulator's replay test with its recording kept
    MEG2="megatron_e32_k4_mbs2x8"; MEG8="megatron_e8_k8_f4096_mbs8x4"
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=120 step ctas_e32 torchrun --standalone \
      --nproc-per-node="$NGPUS" benchmarks/harness/bench_overlap.py --graphs --shapes $MEG2 --profile-shapes \
      $MEG2 --profile-steps 2 --iters 3 --max-ctas default,8,2 --out-dir "$WORK/ctas_e32"
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=120 step ctas_e8 torchrun --standalone \
      --nproc-per-node="$NGPUS" benchmarks/harness/bench_overlap.py --shapes $MEG8 --profile-shapes $MEG8 \
      --profile-steps 2 --iters 3 --max-ctas default,8,2 --out-dir "$WORK/ctas_e8"
    T1="torchrun --standalone --nproc-per-node=1 -m epoverlap.train --preset small --bf16 \
      --deterministic-mode --train-iters 200 --log-interval 50"
    mkdir -p "$WORK/runs"
    for pair in "aux1e-1:--moe-aux-loss-coeff 1e-1|sig_bias_aux5e-2:--moe-router-score-function sigmoid --moe-router-enable-expert-bias" \
                "default_seed3:--seed 3|aux1e-1_seed3:--moe-aux-loss-coeff 1e-1 --seed 3"; do
      gpu=0
      IFS='|' read -ra runs <<< "$pair"
      for run in "${runs[@]}"; do
        name=${run%%:*}; extra=${run#*:}
        CUDA_VISIBLE_DEVICES=$gpu STEP_TIMEOUT=90 step "imb_$name" $T1 $extra \
          --log-json "$WORK/runs/imb_$name.jsonl" &
        gpu=$((gpu + 1))
      done
      wait
    done
    export EPOVERLAP_GPU_LOGS="$WORK/cli_logs"
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=90 step simulator_test python3 -m pytest \
      tests/test_gpu.py -q -k simulator -p no:cacheprovider
    ;;
  cliab)  # NGPUS GPUs: the whole training step as users time it (data, forward-backward,
           # grad reduction, optimizer), this tree against .baseline/ (`git archive COMMIT |
           # tar x -C .baseline`, carried), the order flipped every round; TESTS first
    tests_first cli_tests 300
    [ -d .baseline/epoverlap ] || { echo "cliab: no .baseline/ tree"; exit 2; }
    mkdir -p "$WORK/cli"
    for round in $(seq 1 "${CLI_ROUNDS:-2}"); do
      order="before after"; [ $((round % 2)) -eq 0 ] && order="after before"
      for side in $order; do
        tree=$PWD; [ $side = before ] && tree=$PWD/.baseline
        CUDA_VISIBLE_DEVICES=$TWO_GPUS PYTHONPATH="$tree:$WORK/path" \
          STEP_TIMEOUT=${CLI_TIMEOUT:-150} step "cli_${side}_$round" torchrun --standalone \
          --nproc-per-node="$NGPUS" -m epoverlap.train --preset megatron-cmp --mock-data \
          --expert-model-parallel-size "$NGPUS" --train-iters "${CLI_ITERS:-12}" \
          --log-interval 100 ${CLI_FLAGS---bf16} --log-json "$WORK/cli/${side}_$round.jsonl"
      done
    done
    python3 - "$WORK/cli" <<'PYEOF' | tee -a "$SUMMARY"
import glob, json, statistics, sys
for side in ("before", "after"):
    times = [r["step_time_s"] * 1e3 for f in sorted(glob.glob(f"{sys.argv[1]}/{side}_*.jsonl"))
             for r in map(json.loads, open(f)) if r["step"] > 3]
    if times:
        print(f"cliab {side}: median step {statistics.median(times):.1f} ms over {len(times)} "
              f"steps (min {min(times):.1f}, max {max(times):.1f})")
PYEOF
    ;;
  x2probe)  # 2 GPUs: the overlap probe on the path users run: the training command at the
            # Megatron shapes (PROBE_SHAPES: "mbs2x8", "mbs8x4", "e8"), eager, bf16, optimizer
            # on, --overlap-probe-steps PROBE_STEPS (default 5), with and without delayed wgrad,
            # NVLink and NCCL_P2P_DISABLE=1: which schedule each run keeps, from what figures;
            # PROBE_MODES "eager graphs full" adds the partial graphs and one full-iteration
            # graph over the budget dispatch (a bank per schedule; mind PROBE_ITERS >= 3
            # warm-up + 1 + 2 x PROBE_STEPS); REGIMES ("nvlink nop2p"), WGRAD_MODES ("off on");
            # TESTS (pytest files) first
    export EPOVERLAP_GPU_STEPS=${EPOVERLAP_GPU_STEPS:-20}
    tests_first probe_tests 300
    mkdir -p "$WORK/runs"
    for shape in ${PROBE_SHAPES:-mbs2x8 e8}; do
      case $shape in
        mbs2x8) shape_flags="" ;;
        mbs8x4) shape_flags="--micro-batch-size 8 --num-microbatches 4" ;;
        e8) shape_flags="--num-experts 8 --moe-router-topk 8 --moe-ffn-hidden-size 4096 \
               --micro-batch-size 8 --num-microbatches 4" ;;
        *) echo "x2probe: unknown shape $shape (mbs2x8, mbs8x4, e8)"; exit 2 ;;
      esac
      for regime in ${REGIMES:-nvlink nop2p}; do
        for wgrad_mode in ${WGRAD_MODES:-off on}; do
          wgrad=""; [ "$wgrad_mode" = on ] && wgrad="--delay-wgrad-compute"
          for mode in ${PROBE_MODES:-eager}; do  # graphs: each schedule replays its own bank
            case $mode in
              eager) graph_flags="" ;;
              graphs) graph_flags="--cuda-graph-impl local --cuda-graph-modules attn \
                moe_router moe_preprocess" ;;
              full) graph_flags="--moe-dispatch-budget 1.25 --cuda-graph-impl full_iteration" ;;
              *) echo "x2probe: unknown mode $mode (eager, graphs, full)"; exit 2 ;;
            esac
            p2p=""; [ $regime = nop2p ] && p2p="NCCL_P2P_DISABLE=1"
            name="probe_${shape}_${regime}${wgrad:+_wgrad}${graph_flags:+_$mode}"
            CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=${PROBE_TIMEOUT:-150} step "$name" \
              env $p2p torchrun --standalone --nproc-per-node="$NGPUS" -m epoverlap.train \
              --preset megatron-cmp $shape_flags --bf16 --mock-data \
              --expert-model-parallel-size "$NGPUS" --overlap-moe-expert-parallel-comm $wgrad \
              $graph_flags --overlap-probe-steps "${PROBE_STEPS:-5}" \
              --train-iters "${PROBE_ITERS:-16}" --log-json "$WORK/runs/$name.jsonl"
            { echo "$name:"; grep "overlap probe" "$WORK/$name.log"; } >> "$SUMMARY"
          done
        done
      done
    done
    ;;
  x2ab)  # 2 GPUs: this tree against an earlier one in .baseline/ (ignored by git, carried:
          # `git archive COMMIT | tar x -C .baseline`): the pytest files in TESTS first (if
          # any), then bench_overlap eager at SHAPES (NVLink) and P2P_SHAPES
          # (NCCL_P2P_DISABLE=1), before and after alternated AB_ROUNDS times (the order
          # flipped every round), one table per regime last
    export EPOVERLAP_GPU_STEPS=${EPOVERLAP_GPU_STEPS:-20}
    tests_first ab_tests 300
    [ -d .baseline/epoverlap ] || { echo "x2ab: no .baseline/ tree"; exit 2; }
    # the sides differ in the epoverlap package only: this tree's bench_overlap (with
    # --host-nodes), tools and kernels run both
    first=${AB_FIRST_ROUND:-1}  # 2: start with the flipped order (a second call's round)
    for round in $(seq "$first" $((first + ${AB_ROUNDS:-1} - 1))); do
      order="before after"; [ $((round % 2)) -eq 0 ] && order="after before"
      for regime in nvlink nop2p; do
        shapes=${SHAPES:-ratio_h2048_k8_f128,megatron_e32_k4_mbs2x8}
        [ $regime = nop2p ] && shapes=${P2P_SHAPES-ratio_h2048_k8_f128,ratio_h2048_k4_f4096,megatron_e32_k4_mbs2x8}
        [ -n "$shapes" ] || continue
        for side in $order; do
          tree=$PWD; [ $side = before ] && tree=$PWD/.baseline
          p2p=""; [ $regime = nop2p ] && p2p="NCCL_P2P_DISABLE=1"
          after_args=""; [ $side = after ] && after_args=${AFTER_ARGS:-}
          CUDA_VISIBLE_DEVICES=$TWO_GPUS PYTHONPATH="$tree:$WORK/path" \
            STEP_TIMEOUT=${AB_TIMEOUT:-200} step "ab_${regime}_${side}_$round" env $p2p torchrun \
            --standalone --nproc-per-node="$NGPUS" benchmarks/harness/bench_overlap.py --host-nodes \
            --shapes "$shapes" --iters "${ITERS:-4}" --warmup 1 ${BENCH_ARGS:-} $after_args \
            --out-dir "$WORK/ab/$regime/$side/$round"
        done
      done
    done
    python3 - "$WORK/ab" <<'PYEOF' | tee "$WORK/ab_table.md"
import glob, json, statistics, sys
from pathlib import Path
root = Path(sys.argv[1])
for regime in ("nvlink", "nop2p"):
    runs = {side: [json.loads(Path(f).read_text())["results"]
                   for f in sorted(glob.glob(f"{root}/{regime}/{side}/*/bench_overlap.json"))]
            for side in ("before", "after")}
    if not runs["before"] or not runs["after"]:
        continue
    print(f"\n{regime}: fb ms, median over {len(runs['before'])}/{len(runs['after'])} runs "
          "(before/after)\n")
    print("| shape | T_comm | seq before | seq after | ovl before | ovl after | ovl_wgrad before"
          " | ovl_wgrad after | comp before | comp after | seq/ovl before | seq/ovl after |")
    print("|" + " --- |" * 12)
    shapes = [r["shape"] for r in runs["after"][0]]
    for shape in shapes:
        def med(side, mode):
            got = [r[mode]["fb_ms"] for run in runs[side] for r in run
                   if r["shape"] == shape and mode in r]
            return statistics.median(got) if got else float("nan")
        cells = [med("after", "comm")]
        for mode in ("seq", "ovl", "ovl_wgrad", "comp"):
            cells += [med("before", mode), med("after", mode)]
        ratio = [med(side, "seq") / med(side, "ovl") for side in ("before", "after")]
        print(f"| {shape} | " + " | ".join(f"{c:.1f}" for c in cells)
              + f" | {ratio[0]:.3f} | {ratio[1]:.3f} |")
    # host wall ms per step of each node action (mean over ranks, median over runs)
    columns = [(side, mode) for mode in ("seq", "ovl", "comp") for side in ("before", "after")]
    for shape in shapes:
        def host(side, mode, key):
            got = [statistics.mean(rank[key][0] for rank in r[mode]["host_nodes"])
                   for run in runs[side] for r in run if r["shape"] == shape
                   and "host_nodes" in r.get(mode, {})
                   and all(key in rank for rank in r[mode]["host_nodes"])]
            return f"{statistics.median(got):.1f}" if got else "-"
        keys = [k for r in runs["after"][0] if r["shape"] == shape
                for k in r["ovl"].get("host_nodes", [{}])[0]]
        if not keys:
            continue
        print(f"\n{regime}, {shape}: host wall ms per step per node action (mean of ranks)\n")
        print("| node action | " + " | ".join(f"{m} {s}" for s, m in columns) + " |")
        print("|" + " --- |" * (len(columns) + 1))
        for key in keys:
            print(f"| {key} | " + " | ".join(host(s, m, key) for s, m in columns) + " |")
PYEOF
    ;;
  x2prof)  # 2 GPUs: where the eager step's host time goes per mode: bench_overlap at SHAPES
            # with the host wall time of every node action and rank 0's cProfile of one step
            # per mode (top PROFILE_TOP functions by own time; with API_TOP, also rank 0's
            # torch.profiler host self time per aten op / CUDA call), NVLink, then P2P_SHAPES
            # (if any) with NCCL_P2P_DISABLE=1
    CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=${PROF_TIMEOUT:-240} step prof_nvlink torchrun \
      --standalone --nproc-per-node="$NGPUS" benchmarks/harness/bench_overlap.py --host-nodes \
      --python-profile "${PROFILE_TOP:-40}" --api-profile "${API_TOP:-0}" \
      --shapes "${SHAPES:-megatron_e32_k4_mbs2x8}" \
      --iters "${ITERS:-4}" --warmup 1 --out-dir "$WORK/prof/nvlink"
    if [ -n "${P2P_SHAPES:-}" ]; then
      NCCL_P2P_DISABLE=1 CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=${PROF_TIMEOUT:-240} step \
        prof_nop2p torchrun --standalone --nproc-per-node="$NGPUS" -m benchmarks.harness.bench_overlap \
        --host-nodes --python-profile "${PROFILE_TOP:-40}" --api-profile "${API_TOP:-0}" \
        --shapes "$P2P_SHAPES" \
        --iters "${ITERS:-4}" --warmup 1 --out-dir "$WORK/prof/nop2p"
    fi
    ;;
  x2green)  # 2 GPUs: the GEMMs on a CUDA green context of fewer SMs beside NCCL's all-to-all
             # (bench_contention --compute-sms GREEN_SMS, default all,120,112) at GREEN_SHAPES
             # and GREEN_CTAS (max; GREEN_MIN_CTAS: --min-ctas), NCCL_P2P_DISABLE=1 then NVLink
             # (REGIMES); TESTS first
    tests_first green_tests 200
    for regime in ${REGIMES:-nop2p nvlink}; do
      p2p=0; [ "$regime" = nop2p ] && p2p=1
      NCCL_P2P_DISABLE=$p2p CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=${GREEN_TIMEOUT:-200} \
        step "green_$regime" torchrun --standalone --nproc-per-node="$NGPUS" \
        benchmarks/harness/bench_contention.py --loads nccl --computes gemm,grouped --iters 10 \
        --shapes "${GREEN_SHAPES:-ratio_h2048_k8_f128,megatron_e8_k8_f4096_mbs8x4}" \
        --max-ctas "${GREEN_CTAS:-default,8}" ${GREEN_MIN_CTAS:+--min-ctas $GREEN_MIN_CTAS} \
        --compute-sms "${GREEN_SMS:-all,120,112}" \
        --out-dir "$WORK/green_$regime"
    done
    ;;
  x2nccl)  # 2 GPUs: NCCL settings of the host-memory all-to-all (NCCL_P2P_DISABLE=1). Per entry
            # of NCCL_SETS (tag, or tag:VAR=val,VAR=val), bench_contention's nccl load beside the
            # GEMMs at NCCL_SHAPES (CTAs NCCL_CTAS; NCCL's log of the settings it took kept),
            # then, for the tags in STEP_SETS (default all), bench_overlap per STEP_VARIANTS
            # entry (tag:shape:ctas:flags, flags with , for spaces); TESTS first
    tests_first nccl_tests 200
    for set in ${NCCL_SETS:-base}; do
      env_set "$set"; tag=$SET_TAG
      NCCL_P2P_DISABLE=1 CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=${NCCL_TIMEOUT:-120} \
        step "nccl_${tag}_contention" env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=ENV "${SET_ENVS[@]}" \
        torchrun --standalone --nproc-per-node="$NGPUS" -m benchmarks.harness.bench_contention --loads nccl \
        --computes gemm,grouped --iters 10 --shapes "${NCCL_SHAPES:-ratio_h2048_k8_f128}" \
        --max-ctas "${NCCL_CTAS:-default,8}" --out-dir "$WORK/nccl/$tag/contention"
      case " ${STEP_SETS:-$tag} " in *" $tag "*) ;; *) continue ;; esac
      for variant in ${STEP_VARIANTS:-}; do
        IFS=: read -r vtag shape ctas flags <<< "$variant"
        NCCL_P2P_DISABLE=1 CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=${STEP_TIMEOUT_S:-150} \
          step "nccl_${tag}_$vtag" env "${SET_ENVS[@]}" torchrun --standalone \
          --nproc-per-node="$NGPUS" benchmarks/harness/bench_overlap.py --shapes "$shape" --iters 2 --warmup 1 \
          ${BENCH_ARGS:-} --max-ctas "$ctas" --extra-flags="${flags//,/ }" \
          --out-dir "$WORK/nccl/$tag/$vtag"
      done
    done
    ;;
  x2carve)  # 2 GPUs: the grouped GEMMs' SM carveout and the paired-ends plan (overlap.md run E):
             # bench_overlap per VARIANT (tag:regime:shape:max_ctas:flags[:bench_args], flags
             # and bench_args with , for spaces; max_ctas may be a comma list, swept in one run),
             # profiled with --profile-steps 1 where regime ends in +prof; TESTS first
    export EPOVERLAP_GPU_STEPS=${EPOVERLAP_GPU_STEPS:-12}
    tests_first carve_tests 300
    for variant in ${VARIANTS:-none:nop2p+prof:ratio_h2048_k4_f4096:default: \
        c8:nop2p+prof:ratio_h2048_k4_f4096:8:--moe-grouped-gemm-sm-carveout,8 \
        c8_paired:nop2p+prof:ratio_h2048_k4_f4096:8:--moe-grouped-gemm-sm-carveout,8,--overlap-plan,combined_1f1b_paired_ends \
        f128_c8:nop2p:ratio_h2048_k8_f128:8:--moe-grouped-gemm-sm-carveout,8 \
        f128_c8_paired:nop2p:ratio_h2048_k8_f128:8:--moe-grouped-gemm-sm-carveout,8,--overlap-plan,combined_1f1b_paired_ends \
        f128:nvlink:ratio_h2048_k8_f128:default: \
        f128_paired:nvlink:ratio_h2048_k8_f128:default:--overlap-plan,combined_1f1b_paired_ends}; do
      IFS=: read -r tag regime shape ctas flags bench_args <<< "$variant"
      env_p2p=0; prof=""
      case "$regime" in nop2p*) env_p2p=1 ;; esac
      case "$regime" in *+prof) prof="--profile-shapes $shape --profile-steps 1" ;; esac
      NCCL_P2P_DISABLE=$env_p2p CUDA_VISIBLE_DEVICES=$TWO_GPUS STEP_TIMEOUT=200 step \
        "carve_${regime%+prof}_$tag" torchrun --standalone --nproc-per-node="$NGPUS" \
        benchmarks/harness/bench_overlap.py --shapes "$shape" $prof --iters 2 --warmup 1 ${BENCH_ARGS:-} \
        ${bench_args//,/ } --max-ctas "$ctas" \
        --extra-flags="${flags//,/ }" --out-dir "$WORK/carve/${regime%+prof}/$tag"
    done
    ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac

tar czf "$OUTDIR/gpu_$PART.tgz" -C "$WORK" --exclude=./path --exclude=./site . 2>/dev/null
echo; echo "===== summary ($PART)"; cat "$WORK/versions.txt"; cat "$SUMMARY"
for table in "$WORK"/bench_kernels.md "$WORK"/bench_train.md "$WORK"/accum_table.md; do [ -f "$table" ] && cat "$table"; done
for log in "$WORK"/bench_overlap*.log "$WORK"/bench_peer.log "$WORK"/bitwise.log \
    "$WORK"/fusion_ab.log; do
  [ -f "$log" ] && sed -n '/^bench_overlap: /,$p;/^bench_peer: /,$p;/^bitwise check/,$p;/^bench_host --fusion-ab/,$p' "$log"
done
exit 0
