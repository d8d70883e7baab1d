"""The project's GPU checks and benchmarks as data: one recipe per thing measured.

A recipe says what it measures, how many GPUs it needs, the commands it runs (in order, from
the repo root, each under bash) and what it records. `python -m benchmarks.gpu.run NAME ...`
runs recipes and packs each one's record (benchmarks/gpu/run.py). In a command or an env value:
  {python}    the interpreter running the runner
  {torchrun}  {python} -m torch.distributed.run --standalone --nproc-per-node={gpus}
  {gpus}      the GPUs the recipe runs on (`gpus`, or every visible one with all_gpus)
  {out}       the recipe's record folder: what a command writes there comes back in its .tgz
"""

from __future__ import annotations

from benchmarks.gpu.recipe_parts import (BITWISE_RUN, EAGER, FULL_ITERATION, GRAPHS, OVERLAP,
                                         PYTEST, SEQUENTIAL, TIER, TRAIN, TRAIN_BENCH, WGRAD,
                                         Recipe, Step, rounds_step)
from benchmarks.gpu.recipes_chunked import CHUNKED_RECIPES
from benchmarks.gpu.recipes_context import CONTEXT_RECIPES
from benchmarks.gpu.recipes_copy_engine import COPY_ENGINE_RECIPES
from benchmarks.harness.peer_titan_1gpu import PEER_FLAGS, SHAPES as TITAN_SHAPES

MEGATRON_SHAPES = "megatron_e32_k4_mbs2x8,megatron_e32_k4_mbs8x4,megatron_e8_k8_f4096_mbs8x4"
OVERLAP_STEP = ("{torchrun} -m benchmarks.harness.bench_overlap --shapes " + MEGATRON_SHAPES
                + " --warmup 2 --iters 6 --rounds 3 --profile-shapes megatron_e32_k4_mbs2x8"
                  " --profile-steps 2 --out-dir {out}")
# the training command the interleaved rounds time (the Megatron-core comparison's shape)
ROUNDS_COMMAND = (TRAIN + " --preset megatron-cmp --mock-data --bf16"
                  " --expert-model-parallel-size {gpus} --train-iters 15 --log-interval 100 "
                  + EAGER)
ROUNDS = "{python} -m benchmarks.harness.bench_train_rounds --warmup 3 --out {out}"


# the default-path sweep: the command with no path flag, and the hand-picked paths pinned
DEFAULT_PATH_RUN = (TRAIN + " --preset megatron-cmp --mock-data --train-iters 24"
                    " --log-interval 100")
TUNE_FIRST_ITERS = 40
DEFAULT_BITWISE_RUN = (TRAIN + " --preset small --deterministic-mode --seed 3 --train-iters 30"
                       " --log-interval 10")
HAND_PICKED = {"seq_graphs": SEQUENTIAL + " " + GRAPHS, "ovl_graphs": OVERLAP + " " + GRAPHS,
               "seq_full": SEQUENTIAL + " " + FULL_ITERATION,
               "ovl_full": OVERLAP + " " + FULL_ITERATION}


def _default_path_steps(env: dict = None, picked: tuple = tuple(HAND_PICKED),
                        shape: str = "", preset: str = "megatron-cmp",
                        tune_timeout_s: int = 120) -> tuple:
    """A first default run that tunes and fills the cache (its tuning cost in its log), then
    the default (from the cache) and each hand-picked path of `picked` in 3 interleaved
    rounds; `shape`: flags over `preset`'s."""
    run = DEFAULT_PATH_RUN.replace("--preset megatron-cmp", f"--preset {preset}") + shape
    cache = "--tune-cache {out}/tune_cache"
    sides = " ".join([f"--side 'default={cache}'"] + [f"--side '{name}={HAND_PICKED[name]} "
                                                     f"--tune off'" for name in picked])
    # long enough for the tuner's every path (24 steps fit 5 paths; the chunked one makes 6)
    return (Step("tune_first", run + f" --train-iters {TUNE_FIRST_ITERS} {cache} "
                 "--log-json {out}/tune_first.jsonl",
                 env=dict(env or {}), timeout_s=tune_timeout_s),
            Step("rounds", "{python} -m benchmarks.harness.bench_train_rounds --warmup 8 "
                           "--out {out} --rounds 3 " + sides + " -- " + run,
                 env=dict(env or {}), timeout_s=420))


# the budget dispatch fitted to the demand (--moe-dispatch-budget-fit) against the fixed 1.25
# budget, both in one graph of the iteration with the overlap (what the default over NVLink
# ran before the fit): step time, and rows sent over the dropless dispatch's, at a top-4 shape
# (megatron-cmp) and a top-8 one (E8_SHAPE, below), the tuner off
FIXED = HAND_PICKED["ovl_full"] + " --moe-dispatch-budget-memory 20"
FIT_SIDES = {"fixed_ovl_full": FIXED, "fit_ovl_full": FIXED + " --moe-dispatch-budget-fit"}


def _budget_fit_steps(shapes: dict) -> tuple:
    """Per shape (name -> flags over megatron-cmp): the fitted and fixed budgets, 3 rounds."""
    run = DEFAULT_PATH_RUN.replace("--train-iters 24", "--train-iters 20") + " --tune off"
    return tuple(rounds_step(FIT_SIDES, run + flags, f"fit_{name}", timeout_s=270)
                 for name, flags in shapes.items())


# the Qwen3 proxy's tuning run: 0.6 s steps on H100s and a capture per path of 4.3B parameters;
# its rounds time the default against the sequential path alone (a run takes about 50 s: 3
# sides x 3 rounds would pass the rounds step's 420 s)
QWEN3_TUNE_S = 200
# on mock data its learned router collapses whatever the aux loss; steps are timed, as
# Megatron-LM's MoE performance runs are, with the routing forced to balance
QWEN3_BALANCED = " --moe-router-force-load-balancing"
def _kernel_table_steps(run: str) -> tuple:
    """Where `run`'s GPU time goes: 2 profiled eager sequential steps (10-11) with torch.profiler
    traces, their kernel table, then the traces removed (tens of MiB a rank: over what a call
    brings back)."""
    return (Step("profile", f"{run} --train-iters 12 --log-interval 100 --tune off {SEQUENTIAL} "
                 f"{EAGER} --profile-steps 10:11 --profile-dir {{out}}/profile "
                 "--use-pytorch-profiler", timeout_s=240),
            Step("kernel_table", "{python} -m benchmarks.harness.kernel_table {out}/profile "
                 "--steps 2 --top 40 --out {out}/kernel_table.json && "
                 "{python} -m epoverlap.cli.timeline {out}/profile --no-png && "
                 "rm -f {out}/profile/torch-trace-rank*.json", timeout_s=180))


# the defaults issue's other shapes, as flags over megatron-cmp (bench_overlap's SHAPES)
E8_SHAPE = (" --num-experts 8 --moe-router-topk 8 --moe-ffn-hidden-size 4096"
            " --micro-batch-size 8 --num-microbatches 4")
RATIO_SHAPE = (" --num-layers 2 --seq-length 1024 --num-query-groups 4 --moe-ffn-hidden-size"
               " 4096 --micro-batch-size 16 --num-microbatches 4")  # 1:1 with P2P off


# torchtitan 0.3.0 beside Megatron-core and ours (bench_peer --systems torchtitan,...): its wheel
# and the ones its model, EP and training path import that the GPU machines lack. Their torch
# 2.11 lacks the FSDP API 0.3.0 needs, so there its modes are refused by name and its model tests
# skip (peer_torchtitan.torch_problem; benchmarks/peer.md says why no other release serves)
TORCHTITAN_WHEELS = (".whl/torchtitan-*.whl", ".whl/spmd_types-*.whl", ".whl/tyro-*.whl",
                     ".whl/typeguard-*.whl", ".whl/docstring_parser-*.whl",
                     ".whl/megatron_core-*.whl")


def _peer_torchtitan_steps(shapes: tuple, env: dict = None) -> tuple:
    """torchtitan's CPU checks (its model at our shapes), then one bench_peer job per shape
    (its minimal_async_ep buffer is one per process; a stop keeps the other shapes), 2 warmup
    + 4 timed steps: 8 runs a shape, two of them compiled."""
    return (Step("peer_tests", PYTEST + " --junitxml={out}/junit.xml -m 'not slow' "
                                        "tests/benchmarks/test_peer_torchtitan.py",
                 timeout_s=60),) + tuple(
        Step(f"bench_peer_{shape}", "{torchrun} -m benchmarks.harness.bench_peer --systems "
             f"torchtitan,megatron,epoverlap --shapes {shape} --warmup 2 --iters 4 "
             f"--out-dir {{out}}/{shape}", env=dict(env or {}), timeout_s=220)
        for shape in shapes)


# torchtitan at commit d84e83dc4 (the newest whose MoE runs on torch 2.11) beside epoverlap on
# one GPU: its source and the wheels its train path needs, carried as .titan/ (benchmarks/peer.md)
TITAN_CARRY = (".titan/src/torchtitan/train.py", ".titan/whl/tyro-*.whl")


def _peer_titan_recipe(shape: str, eager: bool = True) -> Recipe:
    """epoverlap and torchtitan compiled at one shape, 3 interleaved rounds of 30 steps, and
    torchtitan eager in the first round only (slower than compiled at every shape tried: about
    4-5 minutes, one recipe per shape); `eager` False: not at all (`_compiled` recipes, 3.5-4
    minutes, for two shapes in one device call)."""
    return Recipe(
        f"peer_titan_1gpu_{shape}" + ("" if eager else "_compiled"), 1,
        "epoverlap's default path beside torchtitan d84e83dc4 (its own training command, eager "
        f"and --compile.enable) at --preset {TITAN_SHAPES[shape].preset}, one GPU, 8192 "
        "tokens a step, routing forced to balance, 3 interleaved rounds of 30 steps (the first 10 "
        "left out): tokens/s, step time, MFU by Megatron-LM's formula over 989 TFLOP/s, peak "
        "reserved memory, ratios",
        "peer_titan.json (every run's command, exit status and every step's sample; the "
        "figures), summary.md, logs/ (each run's log; torchtitan's runs' JSON); a profiled "
        "epoverlap run: profiled.jsonl, ktable.json, "
        "roofline.json",
        (Step(f"rounds_{shape}", "{python} -m benchmarks.harness.peer_titan_rounds --shape "
              f"{shape} --rounds 3 --steps 30 --warmup 10 --run-timeout 240 "
              + ("--once titan_eager " if eager else "--skip titan_eager ") + "--out {out}",
              timeout_s=480),
         *_roofline_steps(f"--preset {TITAN_SHAPES[shape].preset} {' '.join(PEER_FLAGS)}")),
        needs=TITAN_CARRY)


def _roofline_steps(flags: str) -> tuple:
    """One profiled run of the training command at `flags` (torch.profiler over steps 20-21),
    its kernel table, the roofline rows (benchmarks/harness/roofline.py) and the timeline's
    tables of the step's parts (host time between the kernels included). The traces stay
    on the machine ({scratch}/profile: tens of MB, past what a call sends back)."""
    return (Step("profiled_run", "rm -rf {scratch}/profile && {torchrun} -m epoverlap.train "
                 + flags + " --train-iters 22 "
                 "--log-interval 1 --log-json {out}/profiled.jsonl --profile-steps 20:21 "
                 "--profile-dir {scratch}/profile --use-pytorch-profiler", timeout_s=150),
            Step("kernel_table", "{python} -m benchmarks.harness.kernel_table "
                 "{scratch}/profile --steps 2 --top 400 --out {out}/ktable.json", timeout_s=120),
            Step("roofline", "{python} -m benchmarks.harness.roofline {out}/ktable.json --flags '"
                 + flags + "' --out {out}/roofline.json", timeout_s=60),
            Step("step_parts", "epoverlap-timeline {scratch}/profile --no-png --out-dir "
                 "{out}/timeline && rm -f {out}/timeline/timeline_trace.json",
                 timeout_s=60))


def _bitwise_steps() -> tuple:
    """Each schedule's run of the same command, then each log against the sequential one."""
    runs = {"seq": SEQUENTIAL + " " + EAGER, "ovl": OVERLAP + " " + EAGER,
            "ovl_wgrad": WGRAD + " " + EAGER, "ovl_wgrad_graphs": WGRAD + " " + GRAPHS}
    steps = [Step(name, " ".join(filter(None, (BITWISE_RUN, flags,
                                               f"--log-json {{out}}/{name}.jsonl"))))
             for name, flags in runs.items()]
    steps += [Step(f"compare_seq_{name}", "{python} -m epoverlap.cli.compare_losses "
                   f"{{out}}/seq.jsonl {{out}}/{name}.jsonl", timeout_s=60)
              for name in runs if name != "seq"]
    return tuple(steps)



# the hierarchical dispatch: a communication-bound shape (top-8 of 64 small experts) on the GPUs
# as 2 emulated hosts, where the flat dispatch sends 4 of a token's 8 rows between hosts and the
# hierarchy about 1. HOSTS_FLAGS: the training flags alone (the simulator takes them after --)
HOSTS_FLAGS = ("--num-layers 2 --hidden-size 2048 --num-attention-heads 16"
               " --num-query-groups 4 --seq-length 1024 --num-experts 64 --moe-router-topk 8"
               " --moe-ffn-hidden-size 1024 --micro-batch-size 2 --num-microbatches 4"
               " --mock-data --bf16 --moe-router-force-load-balancing --expert-model-parallel-size"
               " {gpus} --emulate-hosts 2 --train-iters 10 --log-interval 100 --tune off "
               + GRAPHS)
HOSTS_RUN = TRAIN_BENCH + " " + HOSTS_FLAGS  # its sides include local copies
FLAT = " --moe-dispatch-hierarchy flat"  # with the hosts above, auto would take node
LOCAL_COPY = " --comm-mode local_copy"
HOSTS_SIDES = {"flat_ovl": WGRAD + FLAT,
               "once_ovl": WGRAD + FLAT + " --moe-dispatch-once-per-rank",
               "node_ovl": WGRAD + " --moe-dispatch-hierarchy node",
               "flat_seq": SEQUENTIAL + FLAT,
               "node_seq": SEQUENTIAL + " --moe-dispatch-hierarchy node",
               "comp": OVERLAP + FLAT + LOCAL_COPY}
# the simulator's inputs measured apart from the runs it predicts (hosts_sim_inputs): every comm
# node timed alone at HOSTS_RUN's shape (tokens per rank = micro-batch 2 x seq 1024, HOSTS_CASE
# = its experts:topk), compute recorded with local copies for the all-to-alls; then the four
# runs it predicts, recorded
HOSTS_CASE = "64:8"
HOSTS_TIMING = ("{torchrun} -m benchmarks.harness.bench_host_bytes --hosts 2 --tokens 2048"
                " --hidden 2048 --cases " + HOSTS_CASE + " --time --iters 10 --warmup 3"
                " $([ -f {out}/a2a_links.json ] && echo --links {out}/a2a_links.json)"
                " --out {out}/host_timing.json")
# the sync-free hierarchical dispatch (fixed blocks per host and per host mate) in one graph
# of the whole iteration, beside the dropless one with partial graphs; the graph flags per side
HOSTS_BARE_RUN = (TRAIN_BENCH + " " + HOSTS_FLAGS).replace(" " + GRAPHS, "")
NODE = " --moe-dispatch-hierarchy node"
HOSTS_BUDGET_SIDES = {"node_ovl": WGRAD + NODE + " " + GRAPHS,
                      "node_budget_full": WGRAD + NODE + " --moe-dispatch-budget 1.25"
                                          " --cuda-graph-impl full_iteration",
                      "node_seq": SEQUENTIAL + NODE + " " + GRAPHS,
                      "comp": WGRAD + FLAT + LOCAL_COPY + " " + GRAPHS}
def _hierarchy_tests(select: str = "") -> Step:
    """The hierarchy's multigpu tests (`select`: a -k filter), their logs kept."""
    return Step("pytest", PYTEST + " --junitxml={out}/junit.xml -m multigpu " + select
                + "tests/cli/test_dispatch_hierarchy_cli.py",
                env={"EPOVERLAP_GPU_LOGS": "{out}/cli_logs"}, timeout_s=200)


GRAD_REDUCE_PROFILES = {"node_seq": HOSTS_SIDES["node_seq"],
                        "node_ovl_beside": HOSTS_SIDES["node_ovl"] + " --overlap-grad-reduce",
                        "node_ovl_after": HOSTS_SIDES["node_ovl"],
                        "comp_wgrad": WGRAD + FLAT + LOCAL_COPY}


def _held(dispatch: str) -> str:
    """Local copies, each all-to-all node holding the comm lane as long as `dispatch`'s nodes
    took alone (the median in host_timing.json, measured first): the host then runs ahead of
    the compute as in the runs predicted, and the compute spans are the device's."""
    return (LOCAL_COPY + " --local-copy-hold-us $({python} -m benchmarks.harness."
            f"sim_hosts_check {{out}} --hold-of {dispatch})")


HOSTS_PROFILES = {"comp_seq": SEQUENTIAL + FLAT + _held("per_expert"),
                  "comp_wgrad": WGRAD + FLAT + _held("per_expert"),
                  # by host's own compute (its preprocess, stage-2 permute, reorders)
                  "comp_node_seq": SEQUENTIAL + NODE + _held("by_host"),
                  "comp_node_wgrad": WGRAD + NODE + _held("by_host"),
                  # unheld: the compute alone, realized_share's T_comp (a held step is not)
                  "comp_alone": WGRAD + FLAT + LOCAL_COPY,
                  **{name: HOSTS_SIDES[name]
                     for name in ("flat_seq", "flat_ovl", "node_seq", "node_ovl")}}



# the overlap's realized share by host with the ends paired too (F0 beside F1, B(M-2) beside
# B(M-1)): the seventh session's 2 x 2 runs left about 12.5 ms of a step's edges with nothing
# beside them (benchmarks/multinode.md)
PAIRED = " --overlap-plan combined_1f1b_paired_ends"
SHARE_PROFILES = {"node_seq": HOSTS_SIDES["node_seq"], "node_ovl": HOSTS_SIDES["node_ovl"],
                  "node_paired": HOSTS_SIDES["node_ovl"] + PAIRED,
                  "comp_alone": HOSTS_PROFILES["comp_alone"]}


def _share_steps(profiles: dict, shares: dict, comp: str) -> tuple:
    """HOSTS_RUN profiled (steps 6-9) with each of `profiles` (name -> flags), then each
    share of `shares` (name -> an overlapped profile) against profile_node_seq and the
    compute alone of profile_`comp`."""
    return (tuple(Step(f"profile_{name}", f"{HOSTS_RUN} {flags} --profile-steps 6:9 "
                       f"--profile-dir {{out}}/profile_{name}", timeout_s=100)
                  for name, flags in profiles.items())
            + tuple(Step(f"share_{name}", "{python} -m benchmarks.harness.realized_share "
                         f"--seq {{out}}/profile_node_seq --ovl {{out}}/profile_{ovl} "
                         f"--comp {{out}}/profile_{comp} --out {{out}}/share_{name}.json",
                         timeout_s=60) for name, ovl in shares.items()))


def _tier(name: str, gpus: int, measures: str, select: str, records: str = "",
          env: dict = None, all_gpus: bool = False) -> Recipe:
    """A GPU pytest tier (`select`: its -m and paths), its junit.xml beside the log."""
    return Recipe(name, gpus, measures, "junit.xml (each test's name and result also in the "
                                        "log as it ends)" + records,
                  (Step("pytest", TIER + " --junitxml={out}/junit.xml " + select, env=env or {},
                        timeout_s=560),), all_gpus=all_gpus)


RECIPES = (
    _tier("gpu_tests_1gpu", 1,
          "the GPU pytest tier on one GPU (-m 'gpu and not multigpu') but tests/training: "
          "kernels against the reference, graphs replaying like eager, the sync-free "
          "dispatch, the memory estimate against a measured peak",
          "-m 'gpu and not multigpu' --ignore tests/training tests"),
    _tier("gpu_tests_1gpu_training", 1,
          "the rest of that tier, tests/training: one-GPU CLI runs bitwise (eager, partial "
          "graphs, budget + full iteration, fused loss, resume), the optimizer forms",
          "-m 'gpu and not multigpu' tests/training"),
    _tier("gpu_tests_multigpu", 2,
          "the GPU pytest tier on 2+ GPUs (-m multigpu): the CLI runs bitwise across schedules "
          "under --deterministic-mode, overlap over NCCL, resume, a killed rank, pipeline, the "
          "simulator's replay of a recorded run",
          "-m multigpu tests", "; cli_logs/ (every CLI run's --log-json and output)",
          {"EPOVERLAP_GPU_LOGS": "{out}/cli_logs", "EPOVERLAP_GPU_STEPS": "30"}, all_gpus=True),
    Recipe("bitwise_check", 2,
           "one process per rank, bf16, optimizer on, --deterministic-mode: the raw bits of every "
           "reduced gradient of one step and the losses of 20 steps, sequential vs overlap vs "
           "overlap + delayed wgrad vs early release, and sequential run twice",
           "bitwise.json (per mode: grads bitwise equal, losses identical)",
           (Step("check_bitwise", "{torchrun} -m benchmarks.harness.check_bitwise --steps 20 "
                                  "--out {out}/bitwise.json"),),
           all_gpus=True),
    Recipe("bitwise_cli", 2,
           "the training command users run (--preset small --bf16 --deterministic-mode, "
           "optimizer on, EP = GPUs, 30 steps): sequential, overlap, overlap + delayed wgrad "
           "(each eager), and that with partial CUDA graphs, each log compared bit for bit with "
           "the sequential one (epoverlap-compare-losses: losses and grad norms)",
           "seq.jsonl, ovl.jsonl, ovl_wgrad.jsonl, ovl_wgrad_graphs.jsonl (per step: loss_hex, "
           "grad_norm_hex, step_time_s); the comparisons in their logs",
           _bitwise_steps(), all_gpus=True),
    Recipe("overlap_step_nvlink", 2,
           "forward-backward and full step per schedule (seq, ovl, ovl_wgrad, compute only, the "
           "all-to-alls alone) at the three Megatron-core shapes, 3 interleaved rounds, NVLink",
           "bench_overlap.json (medians and every timed step's samples), spans/ of mbs2x8",
           (Step("bench_overlap", OVERLAP_STEP),)),
    Recipe("overlap_step_nop2p", 2,
           "the same as overlap_step_nvlink with NCCL_P2P_DISABLE=1: the all-to-alls through "
           "host memory",
           "bench_overlap.json (medians and every timed step's samples), spans/ of mbs2x8",
           (Step("bench_overlap", OVERLAP_STEP, env={"NCCL_P2P_DISABLE": "1"}),)),
    Recipe("overlap_step_all_gpus", 2,
           "the overlap benchmark on every visible GPU (EP = GPUs) at the ratio, Megatron-core "
           "and DeepSeek-V3-layer shapes, 2 rounds: what scale.md's simulator is checked against",
           "bench_overlap.json, spans/ of ratio_h2048_k8_f128",
           (Step("bench_overlap", "{torchrun} -m benchmarks.harness.bench_overlap --shapes "
                                  "ratio_h2048_k8_f128,ratio_h2048_k4_f4096," + MEGATRON_SHAPES
                 + ",dsv3_layer --warmup 2 --iters 5 --rounds 2 --profile-shapes "
                   "ratio_h2048_k8_f128 --profile-steps 2 --out-dir {out}"),),
           all_gpus=True),
    Recipe("peer_megatron_core", 2,
           "Megatron-core 0.16.1 beside epoverlap in one job on the same batches, sequential and "
           "overlapped, at the three Megatron-core shapes: step time, tokens/s, TFLOP/s, memory",
           "bench_peer.json (per run: median and every timed step's samples), junit.xml",
           (Step("peer_tests", PYTEST + " --junitxml={out}/junit.xml -m 'gpu or multigpu' "
                                        "tests/benchmarks/test_bench_peer.py", timeout_s=300),
            Step("bench_peer", "{torchrun} -m benchmarks.harness.bench_peer --shapes "
                               + MEGATRON_SHAPES + " --warmup 3 --iters 8 --out-dir {out}")),
           needs=(".whl/megatron_core-*.whl",)),
    Recipe("peer_torchtitan", 2,
           "torchtitan 0.3.0 (its all-to-all and minimal_async_ep dispatch, each eager and "
           "compiled) beside Megatron-core 0.16.1 and epoverlap in one job per shape on the "
           "same batches, at the two mbs8x4 Megatron-core shapes: step time, tokens/s, "
           "TFLOP/s, memory",
           "junit.xml; SHAPE/bench_peer.json per shape (per run: median and every timed "
           "step's samples)",
           _peer_torchtitan_steps(MEGATRON_SHAPES.split(",")[1:]), needs=TORCHTITAN_WHEELS),
    Recipe("peer_torchtitan_mbs2x8", 2,
           "peer_torchtitan at the third Megatron-core shape (megatron_e32_k4_mbs2x8)",
           "as peer_torchtitan",
           _peer_torchtitan_steps(MEGATRON_SHAPES.split(",")[:1]), needs=TORCHTITAN_WHEELS),
    Recipe("peer_torchtitan_nop2p", 2,
           "peer_torchtitan with NCCL_P2P_DISABLE=1 (the all-to-alls through host memory)",
           "as peer_torchtitan",
           _peer_torchtitan_steps(MEGATRON_SHAPES.split(",")[1:], {"NCCL_P2P_DISABLE": "1"}),
           needs=TORCHTITAN_WHEELS),
    *(_peer_titan_recipe(shape) for shape in TITAN_SHAPES),
    *(_peer_titan_recipe(shape, eager=False) for shape in TITAN_SHAPES),
    Recipe("kernel_speed", 1,
           "every Triton kernel op's GPU tests, then its time, GB/s and share of the copy "
           "bandwidth, eager and graphed, host us per call, against the torch reference",
           "junit.xml, bench_kernels.md",
           (Step("kernel_tests", PYTEST + " --junitxml={out}/junit.xml -m gpu tests/kernels",
                 timeout_s=300),
            Step("bench_kernels", "{python} -m benchmarks.harness.bench_kernels "
                                  "--out {out}/bench_kernels.md", timeout_s=300))),
    Recipe("train_step_schedules", 2,
           "the training command's whole step (--preset megatron-cmp --mock-data --bf16, "
           "optimizer on, eager: --cuda-graph-impl none) sequential vs overlap vs overlap + "
           "delayed wgrad, the same command per path, 3 interleaved rounds",
           "train_rounds.json (every step's time per run, medians), logs/*.jsonl",
           (Step("rounds", ROUNDS + " --rounds 3 --side seq=" + SEQUENTIAL + " --side ovl="
                 + OVERLAP + " --side 'ovl_wgrad=" + WGRAD + "' -- " + ROUNDS_COMMAND),)),
    Recipe("default_path_nvlink", 2,
           "the default path (no path flags: bf16, EP = GPUs, the overlap, partial graphs, the "
           "tuner; its decision from a first run's --tune-cache) against hand-picked paths "
           "pinned with --tune off (sequential and overlap with partial graphs, with "
           "full-iteration graphs over the budget dispatch), --preset megatron-cmp, 3 "
           "interleaved rounds, NVLink",
           "tune_first.log (the tuning run: its table and step times), train_rounds.json "
           "(every step's time per run), logs/*.jsonl", _default_path_steps()),
    Recipe("budget_fit", 2,
           "the budget dispatch fitted to the demand against the fixed 1.25 budget (overlap, "
           "one graph of the iteration, --tune off), NVLink, 3 interleaved rounds each, at "
           "megatron-cmp (top-4 of 32) and the e8 shape (top-8 of 8): step time and the rows "
           "the fixed blocks sent other ranks over the dropless dispatch's (dispatch_wire)",
           "fit_*/train_rounds.json (per step: ms, budget, dispatch_wire), fit_*/logs/",
           _budget_fit_steps({"megatron_cmp": "", "e8_k8": E8_SHAPE})),
    Recipe("symm_a2a", 2,
           "the dispatch's all-to-all with split sizes on the device (symmetric memory's "
           "all_to_all_vdev over NVSHMEM, eager and from a CUDA graph) against NCCL's with "
           "exact splits and with fixed blocks (the budget's), 8192 and 32768 rows of 2048 "
           "bf16 per rank, balanced and skewed 1.25, NVLink",
           "symm_a2a.json (per case: every sample, medians, GB/s per GPU, output checked, "
           "whether it captures)",
           (Step("symm_a2a", "{torchrun} -m benchmarks.harness.bench_symm_a2a --iters 20 "
                             "--out {out}/symm_a2a.json", timeout_s=240),)),
    Recipe("default_path_all_gpus", 2,
           "default_path_nvlink on every visible GPU (EP = GPUs), against the sequential paths "
           "and the fastest hand-picked overlap path of 2 GPUs (full-iteration graphs)",
           "as default_path_nvlink",
           _default_path_steps(picked=("seq_graphs", "seq_full", "ovl_full")), all_gpus=True),
    Recipe("default_path_all_gpus_nop2p", 2,
           "default_path_all_gpus with NCCL_P2P_DISABLE=1, against the best sequential path of "
           "2 GPUs there (partial graphs)",
           "as default_path_nvlink",
           _default_path_steps({"NCCL_P2P_DISABLE": "1"}, picked=("seq_graphs",)),
           all_gpus=True),
    Recipe("default_path_e8", 2,
           "default_path_nvlink at megatron-cmp with 8 experts top-8 of FFN 4096, micro-batch "
           "8 x 4 (bench_overlap's megatron_e8_k8_f4096_mbs8x4), against the sequential and "
           "overlapped full-iteration graphs (the fastest pair over NVLink at megatron-cmp)",
           "as default_path_nvlink",
           _default_path_steps(picked=("seq_full", "ovl_full"), shape=E8_SHAPE)),
    Recipe("default_path_ratio_nop2p", 2,
           "default_path_nop2p at the shape where the all-to-all through host memory is about "
           "1:1 with compute (bench_overlap's ratio_h2048_k4_f4096), against the sequential "
           "paths and the overlap with partial graphs",
           "as default_path_nvlink",
           _default_path_steps({"NCCL_P2P_DISABLE": "1"},
                               picked=("seq_graphs", "seq_full", "ovl_graphs"),
                               shape=RATIO_SHAPE)),
    Recipe("default_path_qwen3", 2,
           "default_path_nvlink at the qwen3-30b-a3b-proxy preset (128 experts top-8, expert "
           "FFN 768, seq 4096, vocab 151936), against the sequential path with partial "
           "graphs, the routing forced to balance; its step lines give TFLOP/s and MFU by "
           "Megatron-LM's formula",
           "as default_path_nvlink",
           _default_path_steps(picked=("seq_graphs",), preset="qwen3-30b-a3b-proxy",
                               shape=QWEN3_BALANCED, tune_timeout_s=QWEN3_TUNE_S)),
    Recipe("default_path_qwen3_nop2p", 2,
           "default_path_qwen3 with NCCL_P2P_DISABLE=1",
           "as default_path_nvlink",
           _default_path_steps({"NCCL_P2P_DISABLE": "1"}, picked=("seq_graphs",),
                               preset="qwen3-30b-a3b-proxy", shape=QWEN3_BALANCED,
                               tune_timeout_s=QWEN3_TUNE_S)),
    Recipe("default_path_nop2p", 2,
           "default_path_nvlink with NCCL_P2P_DISABLE=1 (the all-to-alls through host memory)",
           "as default_path_nvlink", _default_path_steps({"NCCL_P2P_DISABLE": "1"})),
    Recipe("default_path_bitwise", 2,
           "the default path's bits (--preset small --deterministic-mode, optimizer on, EP = "
           "GPUs, 30 steps): the tuned run twice, and against the run pinned with --tune off",
           "tuned.jsonl, tuned_again.jsonl, pinned.jsonl; the comparisons in their logs",
           (Step("tuned", DEFAULT_BITWISE_RUN + " --log-json {out}/tuned.jsonl"),
            Step("tuned_again", DEFAULT_BITWISE_RUN + " --log-json {out}/tuned_again.jsonl"),
            Step("pinned", DEFAULT_BITWISE_RUN + " --tune off --log-json {out}/pinned.jsonl"),
            Step("compare_again", "{python} -m epoverlap.cli.compare_losses {out}/tuned.jsonl "
                                  "{out}/tuned_again.jsonl", timeout_s=60),
            Step("compare_pinned", "{python} -m epoverlap.cli.compare_losses {out}/tuned.jsonl "
                                   "{out}/pinned.jsonl", timeout_s=60)),
           all_gpus=True),
    Recipe("emulated_hosts", 2,
           "--emulate-hosts: the GPUs as hosts of their own (NCCL_HOSTID per emulated host); the "
           "training command's transport report names NCCL's network transport between them, "
           "and one inside a host without emulation (tests/parallel/test_transport.py)",
           "junit.xml; cli_logs/ (each run's output with its transport lines); nccl/ (NCCL's "
           "own INFO logs the report read)",
           (Step("pytest", PYTEST + " --junitxml={out}/junit.xml -m multigpu "
                 "tests/parallel/test_transport.py; rc=$?; mkdir -p {out}/nccl; "
                 "cp /tmp/epoverlap-nccl-*.log {out}/nccl/ 2>/dev/null; exit $rc",
                 env={"EPOVERLAP_GPU_LOGS": "{out}/cli_logs"}, timeout_s=240),),
           all_gpus=True),
    Recipe("train_step_vs_baseline", 2,
           "the training command's whole step (the train_step_schedules command, eager, "
           "sequential: --no-overlap-moe-expert-parallel-comm on both sides, which the earlier "
           "tree must take) of this tree against an earlier one carried in .baseline/ (`git "
           "archive COMMIT | tar x -C .baseline`), 4 interleaved rounds, each side run from its "
           "own tree",
           "train_rounds.json (every step's time per run, medians), logs/*.jsonl",
           (Step("rounds", ROUNDS + " --rounds 4 --side before@.baseline=" + SEQUENTIAL
                 + " --side after=" + SEQUENTIAL + " -- " + ROUNDS_COMMAND),),
           needs=(".baseline/epoverlap",)),
    Recipe("host_cost_graphs", 1,
           "host CPU and wall ms of one forward-backward (shape small, EP 1): eager, partial "
           "graphs, the sync-free dispatch eager and under whole-layer and full-iteration "
           "graphs, and the host time per node action",
           "bench_host.json",
           (Step("bench_host", "{python} -m benchmarks.harness.bench_host --sync-free "
                               "--out {out}/bench_host.json"),)),
    Recipe("train_throughput", 2,
           "the training job without overlap on 1 GPU and on 2 GPUs (EP 2), learned and "
           "balanced routing: step time, tokens/s, TFLOP/s/GPU, load imbalance, peak memory",
           "bench_train.md",
           (Step("bench_train", "{python} -m benchmarks.harness.bench_train --gpus 1,2 --preset "
                                "small --iters 30 --out {out}/bench_train.md"),)),
    Recipe("contention_gemm_comm", 2,
           "what a GEMM and the experts' grouped GEMM lose beside the all-to-all and copy "
           "loads on the comm stream, and what the loads lose beside them, NVLink and "
           "NCCL_P2P_DISABLE=1",
           "nvlink/ and nop2p/ (bench_contention's JSON)",
           (Step("nvlink", "{torchrun} -m benchmarks.harness.bench_contention "
                           "--out-dir {out}/nvlink", timeout_s=270),
            Step("nop2p", "{torchrun} -m benchmarks.harness.bench_contention "
                          "--out-dir {out}/nop2p", env={"NCCL_P2P_DISABLE": "1"},
                 timeout_s=270))),
    Recipe("determinism_price", 1,
           "the price of --deterministic-mode with and without torch's fill of new memory, "
           "eager and graphed, settings alternated step by step in one process, and the "
           "training command's bits in each setting",
           "the tables in the step's log",
           (Step("bench_determinism", "{python} -m benchmarks.harness.bench_determinism "
                                      "--cli-rounds 1 --steps 40 --ab-rounds 20"),)),
    Recipe("optimizer_step", 1,
           "the AdamW step in each of torch's forms (fused, foreach, single) at the "
           "megatron-cmp and small presets: host and GPU time, launches, bit differences",
           "the tables in the steps' logs",
           tuple(Step(f"bench_optim_{preset}", "{python} -m benchmarks.harness.bench_optim "
                      f"--preset {preset} --rounds 10 --iters 5", timeout_s=250)
                 for preset in ("megatron-cmp", "small"))),
    Recipe("loss_kernel", 1,
           "the fused cross-entropy against the torch loss it replaces, alone and as the "
           "model's loss node: host and GPU time, launches, peak memory, bits",
           "the tables in the step's log",
           (Step("bench_loss", "{python} -m benchmarks.harness.bench_loss --shapes "
                               "1024x257,4096x257,8192x32000,4096x151936 --rounds 10 "
                               "--iters 5"),)),
    Recipe("wgrad_kernel", 1,
           "weight grads accumulated inside the GEMM at the Qwen3 proxy's shapes: the grouped "
           "kernel's, the dense fused path's, the norms' and the embedding's GPU tests (the "
           "last two against the unfused path bit for bit, and in training), then their time "
           "against the GEMM and the fp32 add (TFLOP/s, GB/s, the grouped kernel's tiles swept) "
           "and the norms' and the embedding's against their backward then the add",
           "junit.xml, the table in the bench step's log",
           (Step("wgrad_tests", PYTEST + " --junitxml={out}/junit.xml -m gpu "
                                         "tests/kernels/test_grouped_wgrad.py "
                                         "tests/model/test_grad_accumulation.py "
                                         "tests/kernels/test_main_grad_ops.py "
                                         "tests/training/test_grad_placement.py", timeout_s=450),
            Step("bench_wgrad", "{python} -m benchmarks.harness.bench_wgrad --sweep --rounds 5 "
                                "--iters 10", timeout_s=300),
            Step("bench_main_grad_ops", "{python} -m benchmarks.harness.bench_main_grad_ops",
                 timeout_s=120))),
    Recipe("pipeline_bubble", 2,
           "the pipeline's GPU tests, then its bubble fraction measured (spans) against the "
           "analytic one, overlap on and off, and PP = GPUs against EP = GPUs",
           "junit.xml, bench_pipeline.json",
           (Step("pipeline_tests", PYTEST + " --junitxml={out}/junit.xml -m 'gpu or multigpu' "
                                            "tests/schedule/test_pipeline_gpu.py", timeout_s=250),
            Step("bench_pipeline", "{python} -m benchmarks.harness.bench_pipeline --gpus {gpus} "
                                   "--preset small --num-layers 8 --iters 12 --out-dir {out}",
                 timeout_s=300))),
    Recipe("by_host_checks", 2,
           "--moe-dispatch-hierarchy node on GPUs: the multigpu test (2 GPUs as 2 hosts of 1: "
           "the flat once-per-rank bits, overlap on and off, NCCL's network transport between "
           "hosts), the bytes each dispatch sends between hosts against the simulator (the "
           "GPUs as 2 hosts), and one round of the training command per side at the "
           "communication-bound shape (HOSTS_RUN)",
           "junit.xml, cli_logs/, host_bytes.json, calibrate/train_rounds.json",
           (_hierarchy_tests(),
            Step("host_bytes", "{torchrun} -m benchmarks.harness.bench_host_bytes --hosts 2 "
                               "--out {out}/host_bytes.json", timeout_s=90),
            rounds_step(HOSTS_SIDES, HOSTS_RUN, "calibrate", rounds=1, timeout_s=300)),
           all_gpus=True),
    Recipe("by_host_step", 2,
           "the training command at the communication-bound shape on the GPUs as 2 emulated "
           "hosts, per dispatch (flat, once per rank, by host; overlap + delayed wgrad, and "
           "sequential), and compute alone (local copies), 3 interleaved rounds",
           "profile_*/ (span timelines of steps 8-10, by host, overlap and sequential), "
           "step/train_rounds.json (every step's time per run), step/logs/",
           tuple(Step(f"profile_{name}", f"{HOSTS_RUN} {HOSTS_SIDES[name]} --profile-steps 8:10 "
                      f"--profile-dir {{out}}/profile_{name} && {{python}} -m "
                      f"epoverlap.cli.timeline {{out}}/profile_{name} --no-png", timeout_s=90)
                 for name in ("node_ovl", "node_seq"))
           + (rounds_step(HOSTS_SIDES, HOSTS_RUN, "step", timeout_s=480),), all_gpus=True),
    Recipe("grad_reduce_share", 2,
           "--overlap-grad-reduce on the GPUs as 2 emulated hosts at HOSTS_RUN's shape, by host: "
           "profiled runs sequential, overlap + delayed wgrad with the gradients' reduce beside "
           "the backward (--overlap-grad-reduce) and after it (the default), and compute "
           "alone; the realized share of each on the forward-backward and on whole steps",
           "profile_*/ (span files of steps 6-9), share_beside.json, share_after.json",
           _share_steps(GRAD_REDUCE_PROFILES, {"beside": "node_ovl_beside",
                                                "after": "node_ovl_after"}, "comp_wgrad"),
           all_gpus=True),
    Recipe("hosts_share_paired", 2,
           "the realized share of the by-host overlap on the GPUs as 2 emulated hosts, with the "
           "combined 1F1B and with its ends paired (--overlap-plan combined_1f1b_paired_ends), "
           "from profiled runs (steps 6-9) against the sequential run and the compute alone",
           "profile_*/ (span files), share_ovl.json, share_paired.json",
           _share_steps(SHARE_PROFILES, {"ovl": "node_ovl", "paired": "node_paired"},
                        "comp_alone"),
           all_gpus=True),
    Recipe("hosts_sim_inputs", 2,
           "the simulator on the GPUs as 2 emulated hosts from inputs measured apart from the "
           "runs it predicts: each comm node of each dispatch timed alone at HOSTS_RUN's shape "
           "(bench_host_bytes --time; the link peaks of bench_a2a_links, and each all-to-all "
           "beside a loop of 4096^3 GEMMs: the simulator's --comm-beside-compute), compute "
           "recorded with "
           "local copies held on the comm lane for the dispatch's median node time (sequential; "
           "overlap + delayed wgrad; flat and by host; and unheld, the compute alone of the "
           "realized share), then the four runs it predicts "
           "recorded (flat and by host, sequential and overlap + delayed wgrad) and the "
           "simulated step set against each (sim_hosts_check)",
           "a2a_links.json, host_timing.json (per node: median, samples, bytes, GB/s), "
           "host_timing_exchange_beside.json (the same, an exchange beside each node), "
           "profile_*/ (span files of steps 6-9), sim_hosts_check.json (per run: simulated, "
           "measured, error, the command)",
           (Step("a2a_links", "{torchrun} -m benchmarks.harness.bench_a2a_links --emulate-hosts 2"
                              " --mib 16,64 --iters 10 --beside-gemm 4096 --out "
                              "{out}/a2a_links.json", timeout_s=180),
            Step("host_timing", HOSTS_TIMING, timeout_s=150),
            # the same with a split-size exchange beside each node: whether the overlapped
            # run's all-to-alls are slower for the next microbatch's exchange beside them
            Step("host_timing_exchange_beside", HOSTS_TIMING.replace(
                "host_timing.json", "host_timing_exchange_beside.json") + " --exchange-beside",
                 timeout_s=150))
           + tuple(Step(f"profile_{name}", f"{HOSTS_RUN} {flags} --profile-steps 6:9 "
                        f"--profile-dir {{out}}/profile_{name}", timeout_s=100)
                   for name, flags in HOSTS_PROFILES.items())
           + (Step("check", "{python} -m benchmarks.harness.sim_hosts_check {out} "
                            "--out {out}/sim_hosts_check.json", timeout_s=120),)
           + tuple(Step(f"share_{name}", "{python} -m benchmarks.harness.realized_share "
                        f"--seq {{out}}/profile_{name}_seq --ovl {{out}}/profile_{name}_ovl "
                        f"--comp {{out}}/profile_comp_alone --out {{out}}/share_{name}.json",
                        timeout_s=60) for name in ("node", "flat")),
           all_gpus=True),
    Recipe("by_host_budget_step", 2,
           "the sync-free hierarchical dispatch (--moe-dispatch-hierarchy node "
           "--moe-dispatch-budget) in one CUDA graph of the whole iteration on the GPUs as 2 "
           "emulated hosts: its bits against the dropless by-host dispatch (2 GPUs as 2 x 1, "
           "4 as 2 x 2), then the step at the communication-bound shape against the dropless "
           "one with partial graphs, sequential, and compute alone, 3 interleaved rounds",
           "junit.xml, cli_logs/, step/train_rounds.json, step/logs/",
           (_hierarchy_tests("-k budget "),
            rounds_step(HOSTS_BUDGET_SIDES, HOSTS_BARE_RUN, "step", timeout_s=330)),
           all_gpus=True),
    Recipe("host_loss_gpus", 4,
           "a lost host on GPUs: two torchrun nodes of 2 GPUs on this machine, each its own "
           "NCCL host identity; the second SIGKILLed mid-run, the first names it within 60 s; "
           "with --max-restarts a new node joins and both resume from the newest checkpoint "
           "(tests/parallel/test_host_loss.py, multigpu)",
           "junit.xml, pytest.log",
           (Step("pytest", PYTEST + " --junitxml={out}/junit.xml -m multigpu -rA "
                 "tests/parallel/test_host_loss.py", timeout_s=400),)),
    Recipe("a2a_link_bandwidth", 2,
           "all-to-all GB/s per GPU inside an emulated host, across emulated hosts (a rail: "
           "NCCL's network transport, NCCL_HOSTID per host) and over all GPUs, 1 to 64 MiB per "
           "rank, against each link's two-way point-to-point peak; the GPUs as 2 emulated hosts "
           "(4 GPUs: 2 x 2, 2 GPUs: 2 x 1), then as one host (no emulation, the reference)",
           "two_hosts.json, one_host.json (every iteration's time per rank, medians, GB/s, "
           "peaks, NCCL's transport per connection)",
           (Step("two_hosts", "{torchrun} -m benchmarks.harness.bench_a2a_links "
                              "--emulate-hosts 2 --out {out}/two_hosts.json", timeout_s=240),
            Step("one_host", "{torchrun} -m benchmarks.harness.bench_a2a_links "
                             "--emulate-hosts 1 --out {out}/one_host.json", timeout_s=240)),
           all_gpus=True),
    Recipe("kernels_qwen3", 2,
           "where the Qwen3-like proxy's step goes (its MFU): 2 profiled eager sequential steps "
           "(routing forced to balance), GPU kernel time by kind and the top 40 kernels per rank "
           "(benchmarks.harness.kernel_table), and the spans' timeline summary",
           "kernel_table.json; profile/ span files and timeline_summary.json",
           _kernel_table_steps(TRAIN + " --preset qwen3-30b-a3b-proxy" + QWEN3_BALANCED)),
    Recipe("kernels_megatron_cmp", 2,
           "kernels_qwen3 at megatron-cmp (EP = GPUs)", "as kernels_qwen3",
           _kernel_table_steps(TRAIN + " --preset megatron-cmp --mock-data --bf16"
                               " --expert-model-parallel-size {gpus}")),
) + CHUNKED_RECIPES + COPY_ENGINE_RECIPES + CONTEXT_RECIPES
