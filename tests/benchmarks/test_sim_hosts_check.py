"""benchmarks/harness/sim_hosts_check.py: the simulator against recorded runs of 4 ranks as 2
hosts, from inputs measured apart from them. Fast: synthetic GPU recordings and a hand-written
node timing; the table's rows, the window it compares (a step's step-level spans left out) and
the command of each row, which reproduces the row. Slow (`slow`): a bench_host_bytes --time,
a local-copy recording and a by-host recording made now on 4 gloo ranks; the table's structure,
not its accuracy (a loaded CPU)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import sim_hosts_check as check
from epoverlap.cli import simulate as sim
from job_control import job_env
from sim_recordings import gpu_recording

REPO = Path(__file__).resolve().parents[2]
TINY = "--preset tiny --expert-model-parallel-size {gpus} --emulate-hosts 2"
NODES = ("F.dispatch", "B.dispatch", "F.combine", "B.combine", "exchange")


def write_timing(path: Path, tokens=512, hidden=128) -> None:
    """bench_host_bytes --time's JSON at the tiny shape: every node 200 us, exchange 10."""
    nodes = {node: {"median_us": 10.0 if node == "exchange" else 200.0} for node in NODES}
    path.write_text(json.dumps({
        "world": 4, "hosts": 2, "tokens_per_rank": tokens, "hidden": hidden, "dtype": "float32",
        "cases": {"8:2": {name: {"timing": {"nodes": nodes}}
                          for name in ("per_expert", "per_rank", "by_host")}}}))


def test_rows_compare_the_forward_backward_window_and_name_their_command(tmp_path, capsys):
    """comp_wgrad and node_ovl recorded (the others not): node_ovl's row is its simulation
    from comp_wgrad and the timing, plus comp_wgrad's prelude, against node_ovl's window,
    which ends at its last plan action (its `optimizer` span is outside); its command, run,
    gives the same T; the rows without recordings say what is missing."""
    layout = sim.build_scenario(sim.parse_args(
        ["--flops", "--", *shlex.split(TINY.format(gpus=4))])).layout
    write_timing(tmp_path / check.TIMING)
    gpu_recording(tmp_path / "profile_comp_wgrad", layout, 4, prelude_us=300.0)
    _hold(tmp_path / "profile_comp_wgrad", 200.0)
    plan_end = gpu_recording(tmp_path / "profile_node_ovl", layout, 4, comm_us=200.0,
                             after_us=5000.0)
    assert check.main([str(tmp_path), "--train-flags", TINY]) == 0
    out = capsys.readouterr().out
    rows = {row["run"]: row for row in json.loads(
        (tmp_path / "sim_hosts_check.json").read_text())["rows"]}
    assert rows["flat_seq"]["missing"] == ["profile_flat_seq", "profile_comp_seq"]
    assert rows["flat_ovl"]["missing"] == ["profile_flat_ovl"]
    row = rows["node_ovl"]
    assert row["mode"] == "wgrad" and row["prelude_ms"] == pytest.approx(0.3)
    assert row["compute_hold_us"] == 200.0  # the recording's hold, from its files
    assert row["measured"]["window"] == ["last plan action's end"]
    assert row["measured_ms"] == pytest.approx(plan_end / 1e3)
    assert row["simulated_ms"] == pytest.approx(row["simulated_T_ms"] + 0.3)
    assert row["error"] == pytest.approx(row["simulated_ms"] / row["measured_ms"] - 1)
    flags = shlex.split(row["command"].split("epoverlap-simulate ", 1)[1])
    assert flags[:4] == ["--spans", str(tmp_path / "profile_comp_wgrad"), "--comm-from",
                         str(tmp_path / check.TIMING)]
    assert flags[-3:] == ["--delay-wgrad-compute", "--moe-dispatch-hierarchy", "node"]
    assert check.simulate_ms(flags, "wgrad") == pytest.approx(row["simulated_T_ms"])
    assert f"| node_ovl | T_wgrad | {row['simulated_T_ms']:.1f} |" in out
    assert "| flat_seq | - |" in out


def _links(path: Path) -> None:
    """bench_a2a_links --beside-gemm's records: the rail slows 1.1x at 16 MiB, 1.25x at 64;
    the flat group 1.4x at 64."""
    def result(group, mib, slowdown):
        return {"group": group, "bytes": mib * 2 ** 20, "ms": 10.0,
                "beside_gemm": {"ms": 10.0 * slowdown, "slowdown": slowdown}}
    path.write_text(json.dumps({"results": [result("inter", 16, 1.1), result("inter", 64, 1.25),
                                            result("flat", 64, 1.4), result("intra", 64, 3.0)]}))


def test_the_links_slowdown_beside_compute_of_the_runs_inter_host_group(tmp_path):
    """Each run takes the slowdown of the group its bytes between hosts take, at the largest
    size, into its simulation (its command says so); without a2a_links.json, none."""
    assert check.beside_factor(tmp_path, "flat_ovl")[0] == 1.0
    _links(tmp_path / check.LINKS)
    assert check.beside_factor(tmp_path, "flat_ovl")[0] == pytest.approx(1.4)
    assert check.beside_factor(tmp_path, "node_seq") == (pytest.approx(1.25),
                                                        "a2a_links.json group inter, 64 MiB "
                                                        "per rank")
    layout = sim.build_scenario(sim.parse_args(
        ["--flops", "--", *shlex.split(TINY.format(gpus=4))])).layout
    write_timing(tmp_path / check.TIMING)
    gpu_recording(tmp_path / "profile_comp_wgrad", layout, 4, prelude_us=300.0)
    gpu_recording(tmp_path / "profile_node_ovl", layout, 4, comm_us=200.0)
    row = check.check_run(tmp_path, "node_ovl", TINY)
    assert row["comm_beside_compute"] == pytest.approx(1.25)
    flags = shlex.split(row["command"].split("epoverlap-simulate ", 1)[1])
    assert flags[4:6] == ["--comm-beside-compute", "1.25"]
    plain = flags[:4] + flags[6:]
    assert row["simulated_T_ms"] > check.simulate_ms(plain, "wgrad")


def _hold(folder: Path, us: float) -> None:
    """Mark a recording as held (--local-copy-hold-us), as the recorder writes it."""
    for path in folder.glob("spans-rank*.json"):
        document = json.loads(path.read_text())
        path.write_text(json.dumps({**document, "local_copy_hold_us": us}))


def test_the_hold_of_a_dispatch_is_the_median_of_its_nodes_timed_alone(tmp_path, capsys):
    nodes = {"F.dispatch": 4000.0, "B.dispatch": 5000.0, "F.combine": 4200.0,
             "B.combine": 4600.0, "exchange": 900.0}  # the exchange is no node of the lane
    (tmp_path / check.TIMING).write_text(json.dumps({"cases": {check.HOSTS_CASE: {"by_host": {
        "timing": {"nodes": {node: {"median_us": us} for node, us in nodes.items()}}}}}}))
    assert check.main([str(tmp_path), "--hold-of", "by_host"]) == 0
    assert capsys.readouterr().out == "4400\n"
    assert check.main([str(tmp_path), "--hold-of", "per_expert"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--hold-of per_expert" in err


def test_a_timing_of_another_shape_is_one_line_and_exit_2(tmp_path, capsys):
    layout = sim.build_scenario(sim.parse_args(
        ["--flops", "--", *shlex.split(TINY.format(gpus=4))])).layout
    write_timing(tmp_path / check.TIMING, tokens=256)
    gpu_recording(tmp_path / "profile_comp_seq", layout, 4, plan="sequential",
                  delay_wgrad=False)
    gpu_recording(tmp_path / "profile_flat_seq", layout, 4, plan="sequential",
                  delay_wgrad=False)
    assert check.main([str(tmp_path), "--train-flags", TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tokens per rank 256 (the run's: 512)" in err


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
            *args]


@pytest.mark.slow
def test_the_table_runs_on_recordings_made_now(tmp_path):
    model = ("--preset tiny --hidden-size 64 --num-microbatches 2 --expert-model-parallel-size"
             " {gpus} --emulate-hosts 2 --moe-router-force-load-balancing")
    train = shlex.split(model.format(gpus=4)) + ["--train-iters", "3", "--profile-steps", "1:2",
                                                 "--distributed-timeout-minutes", "3"]
    runs = {"comp_wgrad": "--overlap-moe-expert-parallel-comm --delay-wgrad-compute "
                          "--moe-dispatch-hierarchy flat --comm-mode local_copy",
            "node_ovl": check.HOSTS_SIDES["node_ovl"]}
    commands = [_torchrun("-m", "benchmarks.harness.bench_host_bytes", "--hosts", "2",
                          "--tokens", "512", "--hidden", "64", "--cases", "8:2", "--device",
                          "cpu", "--time", "--iters", "2", "--warmup", "1", "--out",
                          str(tmp_path / check.TIMING))]
    commands += [_torchrun("-m", "benchmarks.harness.train_bench", *train, *shlex.split(flags),
                           "--profile-dir", str(tmp_path / f"profile_{name}"))
                 for name, flags in runs.items()]
    for cmd in commands:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=job_env(),
                              cwd=REPO)
        assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run([sys.executable, "-m", "benchmarks.harness.sim_hosts_check",
                           str(tmp_path), "--train-flags", model], capture_output=True,
                          text=True, timeout=300, env=job_env(), cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["run"]: row for row in json.loads(
        (tmp_path / "sim_hosts_check.json").read_text())["rows"]}
    row = rows["node_ovl"]
    assert row["mode"] == "wgrad" and row["measured"]["steps"] == [1, 2]
    assert row["simulated_T_ms"] > 0 and row["measured_ms"] > 0
    assert len(row["measured"]["window"]) == 1  # step_time_us, or the last plan action
    assert "--comm-from" in row["command"] and "| node_ovl | T_wgrad |" in done.stdout
    assert all("missing" in rows[name] for name in ("flat_seq", "flat_ovl", "node_seq"))


def test_by_host_runs_take_compute_from_their_own_local_copy_recording(tmp_path):
    """The by-host runs read `profile_comp_node_*` where recorded (the hierarchy's own compute
    kernels), the flat one otherwise; the flat runs always the flat one."""
    for name in ("profile_comp_seq", "profile_comp_wgrad", "profile_comp_node_wgrad"):
        (tmp_path / name).mkdir()
    assert check.compute_from(tmp_path, "node_ovl").name == "profile_comp_node_wgrad"
    assert check.compute_from(tmp_path, "node_seq").name == "profile_comp_seq"
    assert check.compute_from(tmp_path, "flat_ovl").name == "profile_comp_wgrad"
