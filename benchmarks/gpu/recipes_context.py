"""Context parallelism's GPU recipes (issue 66; benchmarks/context_parallel.md): CP 2 on 2
GPUs and CP 4 on 4, over NVLink and with NCCL_P2P_DISABLE=1 (the K/V exchange through host
memory). Each recipe:

  losses    CP 1 on one GPU against CP N with either K/V exchange (p2p ring, all-gather), the
            same sequences (DP 1), fp32: every step's relative loss gap (`benchmarks.harness.loss_gap`; CP N does CP 1's math in another order);
  rounds    the bf16 step time of CP N p2p, CP N all-gather (overlapped, and the all-gather
            sequential) and the same GPUs as data-parallel replicas at CP 1 (the same global
            batch and tokens per GPU), interleaved rounds (`bench_train_rounds`);
  spans     one profiled CP N all-gather run, replayed by the simulator (measured against
            simulated step time, the kv_gather spans on the comm lane) and listed per node by
            the timeline tool.

The model: megatron-cmp's layers at 4096 tokens a sequence, one sequence per microbatch (the
ring's partial attentions keep fp32 scores of a chunk pair for the backward: s x s per head).
Eager (`--cuda-graph-impl none`): the step times compare the exchanges, not graphs.
"""

from __future__ import annotations

from benchmarks.gpu.recipe_parts import (EAGER, SEQUENTIAL, TRAIN, WGRAD, Recipe, Step,
                                         rounds_step)

MODEL = ("--preset megatron-cmp --mock-data --seq-length 4096 --micro-batch-size 1 "
         "--num-microbatches 8 --log-interval 100 --tune off " + EAGER)
# megatron-cmp's layers with its router learned: its forced balancing draws random logits per
# token from a per-data-rank generator, so CP N (S / N tokens a rank) would route other tokens
# than CP 1 and the losses would part by routing, not by CP's math
LOSS_MODEL = ("--num-layers 4 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 "
              "--num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 1024 --mock-data "
              "--seq-length 4096 --micro-batch-size 1 --num-microbatches 8 --log-interval 100 "
              "--tune off " + EAGER)
# one GPU of the recipe's, through torchrun as the training command runs (CP 1, DP 1, EP 1)
ONE_GPU = ("CUDA_VISIBLE_DEVICES=0 {python} -m torch.distributed.run --standalone "
           "--nproc-per-node=1 -m epoverlap.train")
LOSS_FLAGS = " --no-bf16 --train-iters 20"  # fp32 (on CUDA bf16 is the default)
STEP_FLAGS = " --bf16 --train-iters 12"
COMM_TYPES = ("p2p", "allgather")
LOSS_RTOL = "1e-3"  # fp32: CP N sums the same attention in another order
NO_P2P = {"NCCL_P2P_DISABLE": "1"}


def _cp(cp: int, comm_type: str) -> str:
    return f"--context-parallel-size {cp} --cp-comm-type {comm_type}"


def _loss_steps(cp: int) -> tuple:
    """CP 1 on one GPU (sequential: EP 1 has nothing to overlap), CP `cp` with each exchange
    on the recipe's GPUs (overlapped, delayed weight grads: the same bits as sequential),
    then their gaps."""
    steps = [Step("loss_cp1", f"{ONE_GPU} {LOSS_MODEL}{LOSS_FLAGS} --expert-model-parallel-size 1 "
                  "--log-json {out}/loss_cp1.jsonl", timeout_s=240)]
    steps += [Step(f"loss_cp{cp}_{kind}", f"{TRAIN} {LOSS_MODEL}{LOSS_FLAGS} {WGRAD} "
                   f"--expert-model-parallel-size {cp} {_cp(cp, kind)} --log-json "
                   f"{{out}}/loss_cp{cp}_{kind}.jsonl", timeout_s=240) for kind in COMM_TYPES]
    runs = " ".join(f"{{out}}/loss_cp{cp}_{kind}.jsonl" for kind in COMM_TYPES)
    steps.append(Step("loss_gap", "{python} -m benchmarks.harness.loss_gap "
                      "{out}/loss_cp1.jsonl " + runs + f" --rtol {LOSS_RTOL} --out "
                      "{out}/loss_gap.json", timeout_s=60))
    return tuple(steps)


def _rounds_step(cp: int) -> Step:
    """CP `cp` p2p and all-gather overlapped, the all-gather sequential, and DP = GPUs at
    CP 1 (microbatches / cp each: the same global batch), EP = GPUs throughout."""
    base = f"{TRAIN} {MODEL}{STEP_FLAGS} --expert-model-parallel-size {cp}"
    sides = {f"cp{cp}_p2p": f"{_cp(cp, 'p2p')} {WGRAD}",
             f"cp{cp}_allgather": f"{_cp(cp, 'allgather')} {WGRAD}",
             f"cp{cp}_allgather_seq": f"{_cp(cp, 'allgather')} {SEQUENTIAL}",
             f"dp{cp}": f"--context-parallel-size 1 --num-microbatches {8 // cp} {WGRAD}"}
    return rounds_step(sides, base, "rounds", rounds=2, timeout_s=540)


def _span_steps(cp: int) -> tuple:
    """A profiled CP `cp` all-gather run; the simulator's replay of it; the timeline's
    tables."""
    flags = (f"{MODEL}{STEP_FLAGS} --expert-model-parallel-size {cp} {_cp(cp, 'allgather')} "
             f"{WGRAD}")
    return (Step("spans", f"{TRAIN} {flags} --profile-steps 8:10 --profile-dir {{out}}/spans",
                 timeout_s=240),
            Step("simulate", "{python} -m epoverlap.cli.simulate --spans {out}/spans "
                 "--out-dir {out}/simulate --no-png -- " + flags, timeout_s=120),
            Step("timeline", "{python} -m epoverlap.cli.timeline {out}/spans --out-dir "
                 "{out}/timeline --no-png", timeout_s=120))


def _with_env(steps: tuple, env: dict) -> tuple:
    return tuple(Step(s.name, s.command, {**s.env, **env}, s.timeout_s) for s in steps)


def _recipe(cp: int, over: str, env: dict) -> Recipe:
    steps = _loss_steps(cp) + (_rounds_step(cp),) + _span_steps(cp)
    return Recipe(
        f"context_parallel_cp{cp}_{over}", cp,
        f"context parallelism at CP {cp} on {cp} GPUs, {over}: losses of CP {cp} with the "
        f"p2p ring and the all-gather against CP 1 on one GPU (fp32, 20 steps: every "
        f"step's relative gap); bf16 step time of CP {cp} p2p, all-gather "
        f"(overlapped and sequential) and DP {cp} at CP 1 in 2 interleaved rounds; a profiled "
        f"CP {cp} all-gather run replayed by the simulator",
        "loss_cp1.jsonl, loss_cpN_{p2p,allgather}.jsonl, loss_gap.json; rounds/"
        "train_rounds.json and its logs/; spans/, simulate/simulation.json, "
        "timeline/timeline_summary.json (comm_nodes: the kv_gather rows)",
        _with_env(steps, env))


CONTEXT_RECIPES = tuple(_recipe(cp, over, env) for cp in (2, 4)
                        for over, env in (("nvlink", {}), ("nop2p", NO_P2P)))
