"""Synthetic span recordings for the simulator's tests: a GPU recording (clock cuda_event) of
one plan, every action one after the other on every rank."""

from __future__ import annotations

from epoverlap.profiling.spans import Span, StepSpans, write_rank_span_file
from epoverlap.schedule.pipeline import build_plan
from epoverlap.schedule.plan import action_lane, node_kinds

COMPUTE_US = {"F": 50.0, "B": 80.0, "W": 30.0}  # compute spans by phase


def gpu_recording(folder, layout, microbatches: int, *, plan: str = "combined_1f1b",
                  delay_wgrad: bool = True, comm_us: float = 999.0, ranks: int = 4,
                  prelude_us: float = 5.0, after_us: float = 0.0) -> float:
    """Write the span files of one step (step 6) of `plan` to `folder`: the first action
    queued at `prelude_us`, compute spans by phase (COMPUTE_US), comm spans `comm_us`; with
    `after_us`, a step-level span (`optimizer`, outside the plan's grammar) that long after
    the last action. -> the end of the last plan action (us)."""
    actions = build_plan(plan, layout, microbatches, delay_wgrad)
    kinds = node_kinds(layout)
    for rank in range(ranks):
        clock, spans = prelude_us, []
        for action in actions:
            lane = action_lane(action, kinds)
            took = comm_us if lane == "comm" else COMPUTE_US[action.kind]
            spans.append(Span.from_action(lane, str(action), clock, clock + took, clock))
            clock += took
        plan_end = clock
        if after_us:
            spans.append(Span("compute", "optimizer", 0, None, "optimizer", "forward", clock,
                              clock + after_us, clock))
        write_rank_span_file(folder, rank, ranks, f"cuda:{rank}", "cuda_event",
                             [StepSpans(6, plan_end + after_us, spans)])
    return plan_end
