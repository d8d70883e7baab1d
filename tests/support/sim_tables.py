"""Hand-made durations for the simulator engine's tests: one MoE layer's nodes, compute times
per (phase, node), every all-to-all the same, and the spans of a replay by action name."""

from __future__ import annotations

from epoverlap.model.nodes import COMM, COMPUTE, NodeKind
from epoverlap.simulator.costs import NodeCosts

MOE_LAYER = (NodeKind("attn", COMPUTE, True), NodeKind("dispatch", COMM),
             NodeKind("mlp", COMPUTE, True), NodeKind("combine", COMM))
LAYOUT = [MOE_LAYER]
# hand-made durations (us): compute per (phase, node); every all-to-all 5
COMPUTE_US = {("F", "embed"): 1, ("F", "attn"): 4, ("F", "mlp"): 3, ("F", "loss"): 1,
              ("B", "loss"): 1, ("B", "mlp"): 6, ("B", "attn"): 8, ("B", "embed"): 1,
              ("W", "mlp"): 2, ("W", "attn"): 3}


def table_costs(comm=5.0, host=0.0, sync=0.0, per_rank=None):
    """Costs from the tables above; per_rank[(rank, "F0.attn.L0")] overrides one duration."""
    per_rank = per_rank or {}

    def compute(rank, action):
        return per_rank.get((rank, str(action)), COMPUTE_US[(action.kind, action.node)])

    def comm_us(rank, action):
        return per_rank.get((rank, str(action)), comm)

    def sync_us(rank, action):
        return sync if (action.kind, action.node) == ("F", "dispatch") else 0.0
    return NodeCosts(compute, comm_us, host=lambda r, a: host, sync=sync_us)


def spans_of(result, rank=0):
    return {str(s.action): (s.start_us, s.end_us) for s in result.ranks[rank].spans}
