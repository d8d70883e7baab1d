"""Pipeline schedules as data: 1F1B and interleaved 1F1B steps per stage, their cross-stage
check, and the per-rank grid.

Owns `pipeline_steps` (which forward and backward each stage runs, in order), `pipeline_plans`
(every stage's steps of a plan's form as node actions, through `plan.expand_steps`, transfers
put in order by `order_transfers`), `named_plans` (the one road from a plan's name to its plans,
through the registry `plan.PLANS`) and `build_plan` (its one stage of one chunk),
`simulate_pipeline` / `validate_pipeline` (every stage's plan run together: each P2P transfer
must meet its peer), `format_steps` and `format_pipeline` (one column per stage, one row per
tick of the lock-step run).

The steps follow Megatron-core. With P stages, V model chunks per stage and M microbatches,
stage p runs the forward table

    for each group of microbatches (P at a time; the first group also takes the remainder
    of M / P, so no later group is larger, as the warmup below assumes):
        for chunk v in 0..V-1: for mb in group: F(mb, v)

and the backward table, the same with chunk v replaced by V-1-v. It runs `warmup` forwards
alone, then pairs forward k + warmup with backward k (the steady 1F1B), then the remaining
backwards alone (cooldown), where

    warmup = P - p - 1                            (plain 1F1B, V = 1)
    warmup = 2 (P - p - 1) + (V - 1) G            (interleaved, V > 1; G the first group)

capped at M x V, plus one with the EP overlap (`combined`): the last stage would otherwise pair
F(m) with B(m) of the same microbatch, which depend on each other; one more forward in flight
makes every pair of a step independent (Megatron-core adds the same one). With V = P = 1 the
steps are the one-stage plans of `plan`: no warmup is the sequential plan, warmup 1 the
combined 1F1B. Megatron-core refuses M that P does not divide with its default group size; the
first group's remainder lets any M >= P run (checked for P <= 4, V <= 3, M in P..2P+1 by the
tests).

Transfers. A chunk's `send` node forward sends its output activation and its backward receives
that activation's grad; a chunk's `recv` node does the reverse. Each transfer blocks until the
peer issues the matching one (NCCL's send waits for the receive; on the comm lane transfers
run in plan order), so both ends of a link must issue their transfers in the same order, which
the steps alone do not give (in an interleaved warmup every stage ends a forward with a send
at once). `order_transfers` fixes the order: it runs all stages' plans in lock-step, one action
per tick, a transfer only when the peer's next action is the matching one, and when every
stage waits it lets the peer of the lowest stage that offers a send take that receive now (a
receive needs nothing local but, for a grad, its own forward's send). It is deterministic, so
every rank derives the same plans. `simulate_pipeline` runs plans as they are and reports a
deadlock with the stuck actions marked; plans that finish in lock-step finish on the real
lanes too, which only relax the order (the comm lane keeps the plan order of transfers, the
compute lane waits on fewer things).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from epoverlap.model.nodes import COMM, SEND
from epoverlap.schedule.plan import (Action, Chunk, PlanError, PlanForm, Step, action_lane,
                                     as_chunks, combined_1f1b_paired_ends_plan, expand_steps,
                                     node_kinds, plan_form, validate_plan)


# --------------------------------------------------------------------------- steps
def microbatch_groups(num_microbatches: int, stages: int) -> list[range]:
    """Groups of `stages` microbatches; a remainder joins the first group (so every group has
    at least `stages`, and no later group is larger than the first)."""
    count = max(num_microbatches // stages, 1)
    first = num_microbatches - (count - 1) * stages
    return [range(0, first)] + [range(first + i * stages, first + (i + 1) * stages)
                                for i in range(count - 1)]


def forward_table(num_microbatches: int, virtual: int, stages: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each forward in order: group by group, chunk by chunk."""
    return [(mb, v) for group in microbatch_groups(num_microbatches, stages)
            for v in range(virtual) for mb in group]


def warmup_forwards(stage: int, stages: int, virtual: int, first_group: int, total: int,
                    combined: bool) -> int:
    """Forwards a stage runs before its first backward (module docstring)."""
    if virtual == 1:
        warmup = stages - stage - 1
    else:
        warmup = 2 * (stages - stage - 1) + (virtual - 1) * first_group
    return min(warmup + (1 if combined else 0), total)


def pipeline_steps(stage: int, stages: int, virtual: int, num_microbatches: int,
                   combined: bool) -> list[Step]:
    """Stage `stage`'s steps: warmup forwards, steady forward+backward pairs, cooldown."""
    table = forward_table(num_microbatches, virtual, stages)
    backward = [(mb, virtual - 1 - v) for mb, v in table]
    total = len(table)
    first_group = len(microbatch_groups(num_microbatches, stages)[0])
    warmup = warmup_forwards(stage, stages, virtual, first_group, total, combined)
    return ([Step(table[k]) for k in range(warmup)]
            + [Step(table[warmup + k], backward[k]) for k in range(total - warmup)]
            + [Step(None, backward[k]) for k in range(total - warmup, total)])


def pipeline_plans(stage_chunks: Sequence[Sequence[Chunk]], num_microbatches: int,
                   form: PlanForm, delay_wgrad: bool = False) -> list[list[Action]]:
    """Every stage's plan of `form` (stage_chunks[p]: stage p's chunks as its model declares
    them), with the transfers of each link put in one order on both ends (`order_transfers`).
    Paired ends (one stage of one chunk, combined): the warm-up forward beside the next
    forward and the cool-down backward beside the one before it (`plan.paired_ends_steps`)."""
    stages, combined = len(stage_chunks), form.combined
    if form.paired_ends:
        if not combined or stages != 1 or len(stage_chunks[0]) != 1:
            raise ValueError("paired ends need the combined schedule on one stage of one chunk")
        return [combined_1f1b_paired_ends_plan(stage_chunks[0], num_microbatches, delay_wgrad)]
    plans = [expand_steps(pipeline_steps(stage, stages, len(chunks), num_microbatches, combined),
                          chunks, combined, delay_wgrad, form.early_release)
             for stage, chunks in enumerate(stage_chunks)]
    return order_transfers(plans, stage_chunks)


def named_plans(name: str, stage_chunks: Sequence[Sequence[Chunk]], num_microbatches: int,
                delay_wgrad: bool = False) -> list[list[Action]]:
    """Every stage's plan of the plan named `name`: the one road from a plan's name to its
    plans (the registry `plan.PLANS`), for training and, through `build_plan`, the
    simulator."""
    return pipeline_plans(stage_chunks, num_microbatches, plan_form(name), delay_wgrad)


def build_plan(name: str, layout, num_microbatches: int,
               delay_wgrad: bool = False) -> list[Action]:
    """The plan named `name` of one stage of one chunk (`layout`: its layers' node kinds, or
    its chunk): `named_plans` of that one stage."""
    return named_plans(name, [as_chunks(layout)], num_microbatches, delay_wgrad)[0]


# --------------------------------------------------------------------------- transfers
@dataclass(frozen=True)
class Transfer:
    """What a P2P action moves: (activation or grad, microbatch, the layer whose output it is),
    to or from which stage."""

    message: tuple[str, int, int]
    peer: int
    sends: bool


def _layer_owners(stage_chunks: Sequence[Sequence[Chunk]]) -> dict[int, int]:
    return {chunk.first_layer + offset: stage
            for stage, chunks in enumerate(stage_chunks) for chunk in chunks
            for offset in range(len(chunk.layers))}


def transfer_of(action: Action, kinds: dict, owners: dict[int, int]) -> Optional[Transfer]:
    """The transfer a P2P node's F or B action makes; None for any other action."""
    kind = kinds.get(action.node_key)
    if kind is None or kind.p2p is None or action.kind == "W":
        return None
    if kind.p2p == SEND:  # F: activation of this layer out; B: its grad back in
        boundary, peer = action.layer, owners[action.layer + 1]
    else:  # RECV: F: activation of the layer before in; B: its grad back out
        boundary, peer = action.layer - 1, owners[action.layer - 1]
    forward = action.kind == "F"
    return Transfer(("act" if forward else "grad", action.microbatch, boundary), peer,
                    sends=forward == (kind.p2p == SEND))


# --------------------------------------------------------------------------- cross-stage run
@dataclass
class Simulation:
    """Every stage's plan run together, one action per tick (module docstring)."""

    ticks: list[list[Optional[int]]]  # per stage, per action: the tick it ran (None: never)
    stuck: dict[int, str]  # stage -> why its next action cannot run (empty: all finished)
    length: int  # ticks until the last stage finished (or got stuck)


class _Run:
    """The state of a simulated run: each stage's plan, position and what it has done."""

    def __init__(self, plans, stage_chunks):
        owners = _layer_owners(stage_chunks)
        kinds = [node_kinds(chunks) for chunks in stage_chunks]
        self.plans = [list(plan) for plan in plans]
        self.transfers = [[transfer_of(a, kinds[s], owners) for a in plan]
                          for s, plan in enumerate(self.plans)]
        self.position = [0] * len(plans)
        self.done: list[set] = [set() for _ in plans]

    def finished(self) -> bool:
        return all(p >= len(plan) for p, plan in zip(self.position, self.plans))

    def next_transfer(self, stage: int) -> Optional[Transfer]:
        index = self.position[stage]
        return self.transfers[stage][index] if index < len(self.plans[stage]) else None

    def can_run(self, stage: int) -> bool:
        if self.position[stage] >= len(self.plans[stage]):
            return False
        mine = self.next_transfer(stage)
        if mine is None:
            return True
        theirs = self.next_transfer(mine.peer)
        return theirs is not None and _matches(mine, theirs, stage)

    def advance(self, stage: int) -> None:
        action = self.plans[stage][self.position[stage]]
        self.done[stage].add((action.kind, action.microbatch, action.node_key))
        self.position[stage] += 1

    def hoist_receive(self) -> bool:
        """Everyone waits: let some stage take, now, a later receive that its peer is offering
        to send. A receive needs nothing local but, for a grad, its own forward send. Returns
        False when no stage can (a real deadlock)."""
        for sender in range(len(self.plans)):
            offer = self.next_transfer(sender)
            if offer is None or not offer.sends:
                continue
            receiver = offer.peer
            for index in range(self.position[receiver] + 1, len(self.plans[receiver])):
                wanted = self.transfers[receiver][index]
                action = self.plans[receiver][index]
                if wanted is not None and _matches(wanted, offer, receiver) and (
                        action.kind == "F" or ("F", action.microbatch, action.node_key)
                        in self.done[receiver]):
                    self._move(receiver, index, self.position[receiver])
                    return True
        return False

    def _move(self, stage: int, source: int, target: int) -> None:
        for table in (self.plans[stage], self.transfers[stage]):
            table.insert(target, table.pop(source))

    def stuck_reasons(self) -> dict[int, str]:
        reasons = {}
        for stage, index in enumerate(self.position):
            mine = self.next_transfer(stage)
            if mine is None:
                continue
            peer_index = self.position[mine.peer]
            theirs = (str(self.plans[mine.peer][peer_index])
                      if peer_index < len(self.plans[mine.peer]) else "nothing (finished)")
            what = f"{mine.message[0]} of mb {mine.message[1]} after L{mine.message[2]}"
            reasons[stage] = (f"{'sends' if mine.sends else 'receives'} {what} "
                              f"{'to' if mine.sends else 'from'} stage {mine.peer}, which runs "
                              f"{theirs}")
        return reasons


def _matches(mine: Transfer, theirs: Transfer, stage: int) -> bool:
    return theirs.message == mine.message and theirs.peer == stage and theirs.sends != mine.sends


def _simulate(plans, stage_chunks, hoist: bool) -> tuple[list[list[Action]], Simulation]:
    run = _Run(plans, stage_chunks)
    ticks: list[list[Optional[int]]] = [[] for _ in plans]
    tick = 0
    while not run.finished():
        ready = [s for s in range(len(plans)) if run.can_run(s)]
        if not ready:
            if hoist and run.hoist_receive():
                continue
            ticks = [t + [None] * (len(plan) - len(t)) for t, plan in zip(ticks, run.plans)]
            return run.plans, Simulation(ticks, run.stuck_reasons(), tick)
        for stage in ready:
            ticks[stage].append(tick)
            run.advance(stage)
        tick += 1
    return run.plans, Simulation(ticks, {}, tick)


def simulate_pipeline(plans: Sequence[Sequence[Action]],
                      stage_chunks: Sequence[Sequence[Chunk]]) -> Simulation:
    """Run the plans as they are (module docstring); `stuck` says where they deadlock."""
    return _simulate(plans, stage_chunks, hoist=False)[1]


def order_transfers(plans: Sequence[Sequence[Action]],
                    stage_chunks: Sequence[Sequence[Chunk]]) -> list[list[Action]]:
    """The plans with receives moved up where both ends of a link would otherwise wait to send
    (in interleaved warmups every stage sends before it receives): the simulation runs the
    plans and, whenever every stage waits, the lowest stage offering a send has its peer take
    the matching receive now. Deterministic, so every rank derives the same plans."""
    return _simulate(plans, stage_chunks, hoist=True)[0]


# --------------------------------------------------------------------------- validation
class PipelineError(ValueError):
    """Stage plans that cannot run together; the message holds the per-stage grid."""


def validate_pipeline(plans: Sequence[Sequence[Action]], stage_chunks: Sequence[Sequence[Chunk]],
                      num_microbatches: int, delay_wgrad: bool = False) -> Simulation:
    """Each stage's plan valid on its own (`validate_plan`), and all of them together free of
    deadlock (`simulate_pipeline`). Raises PlanError / PipelineError; returns the simulation."""
    for stage, (plan, chunks) in enumerate(zip(plans, stage_chunks)):
        try:
            validate_plan(plan, chunks, num_microbatches, delay_wgrad)
        except PlanError as error:
            raise PipelineError(f"stage {stage}: {error}") from None
    simulation = simulate_pipeline(plans, stage_chunks)
    if simulation.stuck:
        reasons = "; ".join(f"stage {s} {why}" for s, why in sorted(simulation.stuck.items()))
        raise PipelineError(f"pipeline deadlock at tick {simulation.length}: {reasons}\n"
                            + format_pipeline(plans, stage_chunks, simulation))
    return simulation


# --------------------------------------------------------------------------- printing
def format_steps(steps: Sequence[Step], virtual: int = 1) -> str:
    """'F0 F1 F2+B0 F3+B1 B2 B3'; with virtual stages 'F0c0 F1c0 F0c1 ...' (cN: chunk N)."""
    return " ".join(step.label(virtual > 1) for step in steps)


def format_pipeline(plans: Sequence[Sequence[Action]], stage_chunks: Sequence[Sequence[Chunk]],
                    simulation: Optional[Simulation] = None) -> str:
    """One column per stage, one row per tick of the lock-step run (`simulate_pipeline`):
    comm-lane actions in [brackets], '.' where a stage waits, '>>' where a stuck one does.
    A check of order, not a timing model: the real lanes do not wait in lock-step."""
    simulation = simulation or simulate_pipeline(plans, stage_chunks)
    kinds = [node_kinds(chunks) for chunks in stage_chunks]
    grid = [["."] * len(plans) for _ in range(simulation.length + (1 if simulation.stuck else 0))]
    for stage, plan in enumerate(plans):
        for action, tick in zip(plan, simulation.ticks[stage]):
            if tick is not None:
                lane = action_lane(action, kinds[stage])
                grid[tick][stage] = f"[{action}]" if lane == COMM else str(action)
    for stage in simulation.stuck:
        waiting = plans[stage][simulation.ticks[stage].index(None)]
        grid[-1][stage] = f">> {waiting}"
    width = max([len(cell) for row in grid for cell in row] + [9])
    header = "   tick | " + " | ".join(f"{'stage ' + str(s):<{width}}" for s in range(len(plans)))
    lines = [header.rstrip(), "  " + "-" * (len(header) - 2)]
    lines += [f"  {tick:5d} | " + " | ".join(f"{cell:<{width}}" for cell in row).rstrip()
              for tick, row in enumerate(grid)]
    return "\n".join(lines)
