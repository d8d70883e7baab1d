"""The simulator's measured comm source (`epoverlap-simulate --comm-from FILE`,
epoverlap/simulator/comm_table.py), pure CPU: a hand-written bench_host_bytes timing JSON gives
every all-to-all action its node's median and the forward dispatch's host sync the exchange's,
for the run's case and dispatch; a missing case, dispatch timing or node, or another shape, is
refused in one line; a GPU recording (clock cuda_event) of the overlap with delayed weight
grads and local copies supplies compute for every plan (sequential, overlap, flat and by host),
its own comm spans unused."""

from __future__ import annotations

import json

import pytest

from epoverlap.schedule.pipeline import build_plan
from epoverlap.schedule.plan import Action, action_lane, node_kinds
from epoverlap.simulator.comm_table import CommTableError, dispatch_of, read_comm_table
from epoverlap.simulator.costs import A2aShape
from epoverlap.simulator.engine import STREAM
from sim_recordings import COMPUTE_US, gpu_recording

# the tiny preset (hidden 128, 8 experts top-2, micro-batch 4 x seq 128) on 4 ranks as 2 hosts
TINY = ["--preset", "tiny", "--expert-model-parallel-size", "4", "--emulate-hosts", "2"]
NODE_US = {"per_expert": {"F.dispatch": 100.0, "B.dispatch": 110.0, "F.combine": 120.0,
                          "B.combine": 130.0, "exchange": 7.0},
           "per_rank": {"F.dispatch": 60.0, "B.dispatch": 61.0, "F.combine": 62.0,
                        "B.combine": 63.0, "exchange": 8.0},
           "by_host": {"F.dispatch": 40.0, "B.dispatch": 41.0, "F.combine": 42.0,
                       "B.combine": 43.0, "exchange": 9.0}}


def timing_record(case="8:2", tokens=512, hidden=128, dtype="float32", drop=()) -> dict:
    """bench_host_bytes' JSON as --time writes it (only the fields the table reads)."""
    dispatches = {name: {"timing": {"nodes": {node: {"median_us": us, "samples_us": [us]}
                                              for node, us in nodes.items() if node not in drop}}}
                  for name, nodes in NODE_US.items()}
    return {"world": 4, "hosts": 2, "tokens_per_rank": tokens, "hidden": hidden,
            "device": "cpu", "dtype": dtype, "cases": {case: dispatches}}


@pytest.fixture
def timing_file(tmp_path):
    def write(**changes):
        path = tmp_path / "host_timing.json"
        path.write_text(json.dumps(timing_record(**changes)))
        return str(path)
    return write


def shape(**changes) -> A2aShape:
    fields = dict(tokens=512, topk=2, hidden=128, num_experts=8, dtype_bytes=4, ep=4, hosts=2)
    return A2aShape(**{**fields, **changes})


@pytest.mark.parametrize("flags, dispatch", [
    ({}, "per_expert"), ({"once_per_rank": True}, "per_rank"), ({"by_host": True}, "by_host"),
    ({"once_per_rank": True, "by_host": True}, "by_host")])
def test_every_action_gets_its_nodes_median_and_the_dispatch_syncs_for_the_exchange(
        timing_file, flags, dispatch):
    table = read_comm_table(timing_file(), shape(**flags))
    assert dispatch_of(shape(**flags)) == dispatch and table.dispatch == dispatch
    expected = NODE_US[dispatch]
    for kind in "FB":
        for node in ("dispatch", "combine"):
            for microbatch, layer in ((0, 0), (3, 1), (2, 7)):
                action = Action(kind, microbatch, node, layer)
                assert table.comm_us(microbatch % 4, action) == expected[f"{kind}.{node}"]
    assert table.exchange_us == expected["exchange"]


@pytest.mark.parametrize("changes, at, needle", [
    ({"case": "64:8"}, {}, "no case 8:2 (the run's experts:topk); it has 64:8"),
    ({"drop": ("B.combine",)}, {}, "no median_us (a finite number >= 0) for B.combine"),
    ({"drop": ("exchange",)}, {}, "for exchange"),
    ({"tokens": 256}, {}, "tokens per rank 256 (the run's: 512)"),
    ({"dtype": "bfloat16"}, {}, "bytes per element 2 (the run's: 4)"),
    ({}, {"hosts": 1}, "hosts 2 (the run's: 1)"),
])
def test_a_table_that_cannot_give_the_runs_times_is_refused(timing_file, changes, at, needle):
    with pytest.raises(CommTableError, match="--comm-from .*host_timing.json") as error:
        read_comm_table(timing_file(**changes), shape(**at))
    assert needle in str(error.value)


def test_a_missing_dispatch_timing_names_the_flag_that_writes_it(tmp_path):
    record = timing_record()
    del record["cases"]["8:2"]["by_host"]["timing"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(record))
    with pytest.raises(CommTableError, match="no timing of the by_host dispatch .*--time"):
        read_comm_table(str(path), shape(by_host=True))


@pytest.mark.parametrize("flags, needle", [
    (["--moe-router-topk", "4"], "no case 8:4"),
    (["--moe-a2a-waves", "2"], "comm lane also runs"),
    (["--moe-expert-capacity-factor", "1.5"], "times the dropless dispatch; this run's is "
                                              "capacity"),
])
def test_cli_refuses_in_one_line(timing_file, tmp_path, capsys, flags, needle):
    from epoverlap.cli import simulate as sim
    code = sim.main(["--flops", "--comm-from", timing_file(), "--out-dir", str(tmp_path),
                     "--no-png", "--", *TINY, *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err, err


def test_cli_refuses_two_comm_sources(timing_file, tmp_path, capsys):
    from epoverlap.cli import simulate as sim
    code = sim.main(["--flops", "--comm-from", timing_file(), "--link", "fit", "--out-dir",
                     str(tmp_path), "--", *TINY])
    assert code == 2 and "--comm-from and --link fit" in capsys.readouterr().err


# ---------------------------------------------------------------------------- GPU recording
LOCAL_COPY_US = 999.0  # the recording's comm spans: local copies, never the table's times


def test_a_gpu_local_copy_recording_gives_compute_for_every_plan(timing_file, tmp_path):
    """Recorded: overlap + delayed wgrad with local copies. Predicted: sequential, overlap
    and overlap + wgrad, flat and by host: compute by action from the recording (a B action
    without W holds the W's work), every comm action the table's median, the forward
    dispatch's host sync the exchange's, no rank offsets and no replay of the recording."""
    from epoverlap.cli import simulate as sim
    from epoverlap.simulator.scenario import run_mode
    flops = sim.build_scenario(sim.parse_args(["--flops", "--", *TINY]))
    gpu_recording(tmp_path / "spans", flops.layout, flops.cfg.train.num_microbatches,
                  comm_us=LOCAL_COPY_US)
    for hierarchy, dispatch in (("flat", "per_expert"), ("node", "by_host")):
        scenario = sim.build_scenario(sim.parse_args(
            ["--spans", str(tmp_path / "spans"), "--comm-from", timing_file(), "--", *TINY,
             "--moe-dispatch-hierarchy", hierarchy]))
        assert scenario.overlap_lanes == STREAM and scenario.has_wgrad
        assert scenario.recorded is None and scenario.starts is None
        kinds = node_kinds(scenario.layout)
        expected = NODE_US[dispatch]
        deferred = {(a.microbatch, a.node, a.layer) for a in build_plan(
            "combined_1f1b", scenario.layout, scenario.cfg.train.num_microbatches, True)
            if a.kind == "W"}
        for mode in ("seq", "ovl", "wgrad"):
            plan = build_plan("sequential" if mode == "seq" else "combined_1f1b",
                              scenario.layout, scenario.cfg.train.num_microbatches,
                              mode == "wgrad")
            compute = scenario.compute.for_plan(mode == "wgrad")
            for action in plan:
                if action_lane(action, kinds) == "comm":
                    assert scenario.comm(1, action) == expected[f"{action.kind}.{action.node}"]
                    continue
                holds_w = action.kind == "B" and mode != "wgrad" and (
                    action.microbatch, action.node, action.layer) in deferred
                assert compute(2, action) == COMPUTE_US[action.kind] + (
                    COMPUTE_US["W"] if holds_w else 0.0)
            result = run_mode(scenario, mode)
            for rank in result.ranks:  # ranks alike: no wait for a peer in any comm span;
                for s in rank.spans:  # a forward dispatch's may hold its exchange's read
                    if s.lane == "comm":
                        node = expected[f"{s.action.kind}.{s.action.node}"]
                        read = expected["exchange"] if (s.action.kind, s.action.node) == (
                            "F", "dispatch") else 0.0
                        assert node - 1e-6 <= s.end_us - s.start_us <= node + read + 1e-6
        assert scenario.sync(0, Action("F", 0, "dispatch", 1)) == expected["exchange"]
        assert scenario.sync(0, Action("B", 0, "dispatch", 1)) == 0.0
        assert f"(case 8:2, {dispatch})" in scenario.sources[-2]
