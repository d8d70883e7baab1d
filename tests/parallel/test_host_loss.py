"""A lost host (issue 44): every rank of one node killed at once, and the other node's ranks
exit within 60 s naming that host and its ranks (parallel/watch.py: each rank writes its host
into the rendezvous store beside its heartbeat; a report whose silent ranks are all of a host's
ranks names the host as lost).

Pure CPU: which hosts a set of silent ranks makes lost, and the line. Slow tier: two torchrun
"nodes" of 2 gloo ranks each on this machine (`epoverlap-launch --nnodes 2`), the second
node's launcher and ranks SIGKILLed mid-run; and with `--max-restarts`, the lost node started
again: both resume from the newest checkpoint and finish."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from epoverlap.parallel.watch import PeerFailure, lost_hosts, ranks_text
from dist_helpers import free_port
from job_control import Job, children, launcher_cmd


def test_a_host_is_lost_when_every_one_of_its_ranks_is_silent():
    hosts = ["a", "a", "b", "b", "c", "c"]
    assert lost_hosts([2, 3], hosts, me=0) == [("b", [2, 3])]
    assert lost_hosts([2, 3, 5], hosts, me=0) == [("b", [2, 3])]  # c still has rank 4
    assert lost_hosts([1], hosts, me=0) == []  # my own host is never lost
    # rank 2 never said which host it is on: only what is known is named
    assert lost_hosts([2, 3], ["a", "a", None, "b"], me=0) == [("b", [3])]
    failure = PeerFailure(0, 7, "expert-parallel group (ranks 0-3) all_to_all failed (x)",
                          silent=[2, 3], silent_for_s=3.1, hosts_lost=[("b (node 1)", [2, 3])])
    assert str(failure).endswith("ranks 2,3 did not answer (no heartbeat in the last 3.1 s: "
                                 "dead or stopped); host b (node 1) lost (all its ranks: 2,3)")


def _tree(pid: int) -> list[int]:
    found = [pid]
    for child in children(pid):
        found += _tree(child)
    return found


def _environ(pid: int) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


@pytest.mark.slow
def test_the_other_node_names_the_lost_host_and_its_ranks():
    port = free_port()

    def node(rank: int) -> Job:
        return Job(launcher_cmd(
            "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "host-loss", "--nproc", "2", "--preset", "tiny", "--hidden-size", "64",
            "--seq-length", "64", "--num-microbatches", "2", "--mock-data", "--train-iters",
            "2000", "--log-interval", "1", "--distributed-timeout-minutes", "0.25"))
    first = node(0)
    time.sleep(3)  # the first node's agent hosts the rendezvous (it binds the port first)
    second = node(1)
    try:
        assert first.wait_for_line("step    3/2000", 240), first.text("err")[-3000:]
        workers = [pid for pid in _tree(second.proc.pid)[1:]
                   if _environ(pid).get("RANK") is not None]
        envs = [_environ(pid) for pid in workers]
        ranks = sorted(int(env["RANK"]) for env in envs)
        group = {env["GROUP_RANK"] for env in envs}
        assert len(ranks) == 2 and len(group) == 1, envs
        killed = time.monotonic()
        for pid in _tree(second.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = first.finish(timeout_s=60)
        took = time.monotonic() - killed
    finally:
        for job in (first, second):
            if job.proc.poll() is None:
                job.proc.kill()
    text = first.text("out") + "\n" + first.text("err")
    assert code != 0 and took < 60, (code, took, text[-3000:])
    lost = f"(node {group.pop()}) lost (all its ranks: {ranks_text(ranks)})"
    assert lost in text, text[-4000:]


def _torchrun_node(port: int, out: Path, restarts: int) -> Job:
    """One "node" of 2 gloo ranks: torchrun with the c10d rendezvous and --max-restarts,
    saving every 2 steps and resuming from the newest checkpoint."""
    ckpt = str(out / "ckpt")
    return Job([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                "--nproc-per-node=2", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=host-loss-restart",
                f"--max-restarts={restarts}", "-m", "epoverlap.train", "--preset", "tiny",
                "--hidden-size", "64", "--seq-length", "64", "--num-microbatches", "2",
                "--mock-data", "--train-iters", "40", "--log-interval", "1",
                "--distributed-timeout-minutes", "0.25", "--save", ckpt, "--save-interval",
                "2", "--load", ckpt],
               env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


@pytest.mark.slow
def test_after_a_lost_node_comes_back_the_job_resumes_from_the_last_checkpoint(tmp_path):
    """The surviving node's torchrun restarts its ranks (--max-restarts 1) and waits at the
    rendezvous; a new second node joins; both resume from the newest checkpoint and finish."""
    port = free_port()
    first = _torchrun_node(port, tmp_path, 1)
    time.sleep(3)  # the first node's agent hosts the rendezvous
    second = _torchrun_node(port, tmp_path, 0)
    again = None
    try:
        assert first.wait_for_line("checkpoint: saved", 240), first.text("err")[-3000:]
        assert first.wait_for_line("step    5/40", 120), first.text("err")[-3000:]
        for pid in _tree(second.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert first.wait_for_line("lost (all its ranks: 2,3)", 60), first.text("err")[-3000:]
        again = _torchrun_node(port, tmp_path, 0)
        resumed = first.wait_for_line("checkpoint: resuming from", 240)
        assert resumed, first.text("out")[-3000:] + first.text("err")[-3000:]
        assert first.finish(timeout_s=240) == 0, first.text("err")[-3000:]
        assert again.finish(timeout_s=60) == 0, again.text("err")[-3000:]
    finally:
        for job in (first, second, again):
            if job is not None and job.proc.poll() is None:
                job.proc.kill()
    assert "step   40/40" in first.text("out")
