"""All-to-all durations measured apart from any training run: the `timing` of
benchmarks/harness/bench_host_bytes.py --time, read for `epoverlap-simulate --comm-from FILE`.

Owns `CommTable` and `read_comm_table`. The benchmark times, per case (experts:topk) and
dispatch (`per_expert`: the flat dropless dispatch, `per_rank`: --moe-dispatch-once-per-rank,
`by_host`: --moe-dispatch-hierarchy node), the MoE layer's comm nodes as the executor runs them
(F.dispatch, B.dispatch, F.combine, B.combine: the slowest rank's median, us) and the split-size
exchange the forward dispatch reads on the host (`exchange`). The table gives every all-to-all
action of a plan, each layer and microbatch, its node's median, and the forward dispatch's host
sync the exchange's. It was measured with balanced routing at one shape: its ranks, hosts,
tokens per rank, hidden size and row dtype must be the simulated run's, and its case and
dispatch are the run's (`dispatch_of`). Bad input raises `CommTableError`, one line naming the
file and what is wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from epoverlap.schedule.plan import Action
from epoverlap.simulator.costs import A2aShape, MissingDuration

NODES = ("F.dispatch", "B.dispatch", "F.combine", "B.combine")
EXCHANGE = "exchange"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class CommTableError(ValueError):
    """A timing file that cannot give the run's all-to-all times; the message names it."""


@dataclass(frozen=True)
class CommTable:
    """One dispatch's measured node times (us) at one case."""

    path: str
    case: str
    dispatch: str
    node_us: dict  # "F.dispatch" ... -> median us
    exchange_us: float

    def comm_us(self, rank: int, action: Action) -> float:
        """Every rank alike: the slowest rank's median, from the collective's common start."""
        key = f"{action.kind}.{action.node}"
        if key not in self.node_us:
            raise MissingDuration(f"--comm-from {self.path}: no time for {action} (it times "
                                  f"{', '.join(NODES)})")
        return self.node_us[key]

    def describe(self) -> str:
        times = ", ".join(f"{node} {us / 1e3:.3g}" for node, us in self.node_us.items())
        return (f"comm: measured nodes of {self.path} (case {self.case}, {self.dispatch}): "
                f"{times} ms; split sizes back on the host after {self.exchange_us:.0f} us")


def dispatch_of(shape: A2aShape) -> str:
    """The benchmark's name of the run's dispatch."""
    if shape.sends_by_host:
        return "by_host"
    return "per_rank" if shape.sends_once_per_rank else "per_expert"


def read_comm_table(path: str, shape: A2aShape) -> CommTable:
    """The node times of the run's case and dispatch in bench_host_bytes' JSON at `path`."""
    record = _read(path)
    _check_shape(record, shape, path)
    case, dispatch = f"{shape.num_experts}:{shape.topk}", dispatch_of(shape)
    cases = record.get("cases") if isinstance(record.get("cases"), dict) else {}
    if case not in cases:
        raise CommTableError(f"--comm-from {path}: no case {case} (the run's experts:topk); "
                             f"it has {', '.join(cases) or 'none'}")
    timing = (cases[case].get(dispatch) or {}).get("timing")
    if not isinstance(timing, dict):
        raise CommTableError(f"--comm-from {path}: case {case} has no timing of the {dispatch} "
                             "dispatch (bench_host_bytes --time writes it)")
    nodes = timing.get("nodes") or {}
    medians = {node: (nodes.get(node) or {}).get("median_us") for node in NODES + (EXCHANGE,)}
    bad = [node for node, us in medians.items() if not _is_time(us)]
    if bad:
        raise CommTableError(f"--comm-from {path}: case {case} {dispatch}: no median_us (a "
                             f"finite number >= 0) for {', '.join(bad)}")
    return CommTable(path, case, dispatch, {node: float(medians[node]) for node in NODES},
                     float(medians[EXCHANGE]))


def _read(path: str) -> dict:
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise CommTableError(f"--comm-from {path}: cannot read it: "
                             f"{error.strerror or error}") from None
    except ValueError as error:
        raise CommTableError(f"--comm-from {path}: not JSON: {error}") from None
    if not isinstance(record, dict):
        raise CommTableError(f"--comm-from {path}: not bench_host_bytes' JSON (no object)")
    return record


def _check_shape(record: dict, shape: A2aShape, path: str) -> None:
    """The file's shape is the run's: ranks, hosts, tokens per rank, hidden, row bytes."""
    dtype = record.get("dtype", "bfloat16" if record.get("device") == "cuda" else "float32")
    measured = {"ranks": record.get("world"), "hosts": record.get("hosts"),
                "tokens per rank": record.get("tokens_per_rank"),
                "hidden": record.get("hidden"), "bytes per element": DTYPE_BYTES.get(dtype)}
    run = {"ranks": shape.ep, "hosts": shape.hosts, "tokens per rank": shape.tokens,
           "hidden": shape.hidden, "bytes per element": shape.dtype_bytes}
    wrong = [f"{name} {measured[name]} (the run's: {run[name]})" for name in run
             if measured[name] != run[name]]
    if wrong:
        raise CommTableError(f"--comm-from {path}: measured at another shape: "
                             + ", ".join(wrong))


def _is_time(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)
