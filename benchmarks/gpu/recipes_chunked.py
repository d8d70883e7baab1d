"""The GPU recipes of the all-to-alls in waves (`--moe-a2a-waves`, formerly `--moe-a2a-chunks`:
benchmarks/chunked.md); the recipes keep the names their records were made under."""

from __future__ import annotations

from benchmarks.gpu.recipe_parts import (BITWISE_RUN, BUDGET, EAGER, FULL_ITERATION, GRAPHS,
                                         OVERLAP, SEQUENTIAL, TRAIN, TRAIN_BENCH, WGRAD, Recipe,
                                         Step, rounds_step)

# the all-to-alls in waves (--moe-a2a-waves): the shape where the all-to-all is 1:1 with compute
# when it goes through host memory (bench_overlap's ratio_h2048_k4_f4096), the training command
RATIO_1TO1 = ("--num-layers 2 --hidden-size 2048 --num-attention-heads 16 --num-query-groups 4"
              " --seq-length 1024 --num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 4096"
              " --micro-batch-size 16 --num-microbatches 4")
CHUNKED_RUN = (TRAIN_BENCH + " " + RATIO_1TO1  # its sides include local copies
               + " --mock-data --bf16 --moe-router-force-load-balancing"
               " --expert-model-parallel-size {gpus} --train-iters 12 --log-interval 100"
               " --tune off " + GRAPHS)
CHUNKED_SIDES = {"seq": SEQUENTIAL, "seq_k4": SEQUENTIAL + " --moe-a2a-waves 4",
                 "ovl_wgrad": WGRAD, "ovl_wgrad_k4": WGRAD + " --moe-a2a-waves 4",
                 "comp": OVERLAP + " --comm-mode local_copy"}

CHUNKED_BITS = {"seq": SEQUENTIAL + " " + EAGER, "seq_k2": SEQUENTIAL + " " + EAGER
                + " --moe-a2a-waves 2", "ovl_wgrad_graphs_k4": WGRAD + " " + GRAPHS
                + " --moe-a2a-waves 4"}
# the same over the budget dispatch (sync-free), the last one in one graph of the iteration
CHUNKED_BUDGET_BITS = {"seq": SEQUENTIAL + " " + EAGER + " " + BUDGET,
                       "seq_k2": SEQUENTIAL + " " + EAGER + " " + BUDGET + " --moe-a2a-waves 2",
                       "ovl_wgrad_full_k4": WGRAD + " " + FULL_ITERATION
                       + " --moe-a2a-waves 4"}


def _chunked_bitwise_steps(runs: dict) -> tuple:
    """The bitwise command for each of `runs` (the first unchunked sequential), each later one
    compared with the first."""
    steps = [Step(f"bits_{name}", f"{BITWISE_RUN} --train-iters 20 {flags} --log-json "
                  f"{{out}}/{name}.jsonl", timeout_s=120) for name, flags in runs.items()]
    return tuple(steps + [Step(f"compare_seq_{name}", "{python} -m epoverlap.cli.compare_losses "
                               f"{{out}}/seq.jsonl {{out}}/{name}.jsonl", timeout_s=60)
                          for name in runs if name != "seq"])

# one MoE layer's forward + backward, chunked against unchunked, both sequential (the chunks'
# all-to-alls on the comm lane beside their experts), from profiled runs in interleaved rounds
LAYER_TIME_SIDES = {f"k{k}": f"--moe-a2a-waves {k}" for k in (1, 2, 4)}
LAYER_TIME_ROUNDS = 3
# K = 4 with the lanes kept apart: the all-to-all on at most 8 SMs, the grouped GEMMs on the rest
LEVERS = "--moe-a2a-nccl-max-ctas 8 --moe-grouped-gemm-sm-carveout 8"
LAYER_LEVER_SIDES = {"k1": "--moe-a2a-waves 1", "k4": "--moe-a2a-waves 4",
                     "k4_ctas8": f"--moe-a2a-waves 4 {LEVERS}"}


def _layer_time_steps(sides: dict) -> tuple:
    """Per round, a profiled sequential run per side of `sides` (name -> flags; the first the
    unchunked one) at P2P off, then moe_layer_time over every run, each side's rounds pooled."""
    runs = [(r, name) for r in range(1, LAYER_TIME_ROUNDS + 1) for name in sides]
    steps = [Step(f"profile_{name}_r{r}", f"{CHUNKED_RUN} {SEQUENTIAL} {sides[name]} "
                  f"--profile-steps 6:9 --profile-dir {{out}}/profile_{name}_r{r}",
                  env={"NCCL_P2P_DISABLE": "1"}, timeout_s=100) for r, name in runs]
    named = " ".join(f"{name}={{out}}/profile_{name}_r{r}" for r, name in runs)
    return tuple(steps) + (Step("layer_time", "{python} -m benchmarks.harness.moe_layer_time "
                                f"{named} --out {{out}}/moe_layer_time.json", timeout_s=60),)


# megatron-cmp with P2P off, where the tuner timed its chunked path at 2.7x the others' step
MEGATRON_NOP2P_RUN = (TRAIN + " --preset megatron-cmp --mock-data --bf16"
                      " --expert-model-parallel-size {gpus} --train-iters 12 --log-interval 100"
                      " --tune off " + GRAPHS + " " + WGRAD)


def _megatron_chunk_profiles() -> tuple:
    """Profiled runs (steps 8-10, spans) of megatron-cmp overlapped with delayed wgrad, K = 1
    and 4, P2P off; the timeline summary of each and moe_layer_time over both."""
    steps = [Step(f"profile_k{k}", f"{MEGATRON_NOP2P_RUN} --moe-a2a-waves {k} --profile-steps "
                  f"8:10 --profile-dir {{out}}/profile_k{k} && {{python}} -m "
                  f"epoverlap.cli.timeline {{out}}/profile_k{k} --no-png",
                  env={"NCCL_P2P_DISABLE": "1"}, timeout_s=150) for k in (1, 4)]
    return tuple(steps) + (Step("layer_time", "{python} -m benchmarks.harness.moe_layer_time "
                                "k1={out}/profile_k1 k4={out}/profile_k4 --out "
                                "{out}/moe_layer_time.json", timeout_s=60),)


CHUNKED_RECIPES = (
    Recipe("chunked_megatron_profile", 2,
           "why the chunked path (K = 4) is 2.7x slower at megatron-cmp with P2P off: spans of "
           "the overlapped run with delayed wgrad at K = 1 and 4 (steps 8-10), each one's "
           "timeline summary (lanes, exposed communication), and its MoE layers' lane times",
           "profile_k1/, profile_k4/ (spans, timeline_summary.json), moe_layer_time.json",
           _megatron_chunk_profiles()),
    Recipe("chunked_layer_time", 2,
           "one MoE layer's forward + backward wall (dispatch to combine, chunks on both lanes) "
           "at the 1:1 shape with NCCL_P2P_DISABLE=1, sequential, K = 1, 2, 4, from profiled "
           "runs in 3 interleaved rounds (benchmarks.harness.moe_layer_time)",
           "profile_k*_r*/ (span files of steps 6-9), moe_layer_time.json (per K: medians, "
           "every layer part's sample)", _layer_time_steps(LAYER_TIME_SIDES)),
    Recipe("chunked_layer_levers", 2,
           "chunked_layer_time at K = 1, K = 4, and K = 4 with the lanes kept apart (the "
           "all-to-all on at most 8 CTAs, the grouped GEMMs on all SMs but 8): whether the "
           "chunks' all-to-alls and experts slow each other less",
           "as chunked_layer_time", _layer_time_steps(LAYER_LEVER_SIDES)),
    Recipe("chunked_nop2p", 2,
           "--moe-a2a-waves on the GPU CLI path: bits (chunked vs unchunked, bf16, optimizer "
           "on), then the step at the 1:1 shape with NCCL_P2P_DISABLE=1 per path (unchunked and "
           "K = 4, sequential and overlapped; compute alone with local copies), 3 interleaved "
           "rounds",
           "seq.jsonl, seq_k2.jsonl, ovl_wgrad_graphs_k4.jsonl; nop2p/train_rounds.json",
           _chunked_bitwise_steps(CHUNKED_BITS) + (rounds_step(CHUNKED_SIDES, CHUNKED_RUN, "nop2p",
                                                           {"NCCL_P2P_DISABLE": "1"}),)),
    Recipe("chunked_budget_bits", 2,
           "--moe-a2a-waves over --moe-dispatch-budget on the GPU CLI path: bits of K = 2 "
           "sequential and K = 4 overlapped in a full-iteration graph vs the unchunked budget "
           "run (bf16, optimizer on)", "seq.jsonl, seq_k2.jsonl, ovl_wgrad_full_k4.jsonl",
           _chunked_bitwise_steps(CHUNKED_BUDGET_BITS)),
    Recipe("chunked_sweep", 2,
           "--moe-a2a-waves at the 1:1 shape with NCCL_P2P_DISABLE=1: K = 4 sequential (its "
           "chunks on two lanes) and K = 4, 8 with the overlap and paired ends, 3 interleaved "
           "rounds; a profiled run of K = 4 (spans, epoverlap-timeline); 2 microbatches per "
           "step (where the 1F1B hides least), unchunked sequential vs K = 4 overlapped",
           "sweep/, mb2/ train_rounds.json; profile/ spans and timeline_summary.json",
           (rounds_step({"seq": SEQUENTIAL, "seq_k4": SEQUENTIAL + " --moe-a2a-waves 4",
                     "ovl_wgrad_k4": WGRAD + " --moe-a2a-waves 4",
                     "ovl_wgrad_k8": WGRAD + " --moe-a2a-waves 8",
                     "paired_wgrad_k4": WGRAD + " --overlap-plan combined_1f1b_paired_ends"
                                        " --moe-a2a-waves 4"},
                    CHUNKED_RUN, "sweep", {"NCCL_P2P_DISABLE": "1"}),
            Step("profile", CHUNKED_RUN + " " + WGRAD + " --moe-a2a-waves 4 --profile-steps 8:10"
                 " --profile-dir {out}/profile && {python} -m epoverlap.cli.timeline "
                 "{out}/profile --no-png", env={"NCCL_P2P_DISABLE": "1"}, timeout_s=120),
            rounds_step({"seq": SEQUENTIAL, "ovl_wgrad_k4": WGRAD + " --moe-a2a-waves 4"},
                    CHUNKED_RUN + " --num-microbatches 2", "mb2", {"NCCL_P2P_DISABLE": "1"}))),
    Recipe("chunked_report", 2,
           "--moe-a2a-waves 4 against unchunked in the overlap benchmark (T_seq, T_ovl, T_comp "
           "and T_comm, the all-to-alls replayed alone) at the 1:1 shape with "
           "NCCL_P2P_DISABLE=1; the training step over NVLink at that shape, 3 interleaved "
           "rounds",
           "k1/, k4/ bench_overlap.json; nvlink/train_rounds.json",
           tuple(Step(f"overlap_k{k}", "{torchrun} -m benchmarks.harness.bench_overlap --shapes "
                      "ratio_h2048_k4_f4096 --warmup 2 --iters 4 --rounds 1 "
                      f"--out-dir {{out}}/k{k} --extra-flags '--moe-a2a-waves {k}'",
                      env={"NCCL_P2P_DISABLE": "1"}, timeout_s=150) for k in (1, 4))
           + (rounds_step({"seq": SEQUENTIAL, "ovl_wgrad": WGRAD,
                       "ovl_wgrad_k4": WGRAD + " --moe-a2a-waves 4"}, CHUNKED_RUN, "nvlink"),)),
)
