"""A lost host (issue 44): every rank of one node killed at once, and the other node's ranks
exit within 60 s naming that host and its ranks (parallel/watch.py: each rank writes its host
into the rendezvous store beside its heartbeat; a report whose silent ranks are all of a host's
ranks names the host as lost).

Pure CPU: which hosts a set of silent ranks makes lost, and the line. Slow tier: two torchrun
"nodes" of 2 gloo ranks each on this machine (`epoverlap-launch --nnodes 2`), the second
node's launcher and ranks SIGKILLed mid-run; and with `--max-restarts`, the lost node started
again: both resume from the newest checkpoint and finish. Multigpu tier (4 GPUs): the same
loss with two "nodes" of 2 GPUs each, NCCL, each node its own NCCL host identity."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from epoverlap.parallel.watch import PeerFailure, lost_hosts, ranks_text
from dist_helpers import free_port
from job_control import Job, descendants, environ, launcher_cmd


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


def _wait_for_listener(port: int, job: Job, timeout_s: float = 60.0) -> None:
    """Until something listens on `port` (the first node's agent hosting the rendezvous: the
    node started next must join it, not host it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and job.proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on port {port}: " + job.text("err")[-2000:])


def _workers(job: Job, timeout_s: float = 180.0) -> list[dict]:
    """The environments of a node's 2 training ranks, once both run."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and job.proc.poll() is None:
        envs = [env for env in map(environ, descendants(job.proc.pid)) if "RANK" in env]
        if len(envs) == 2:
            return envs
        time.sleep(0.2)
    raise AssertionError("the node's ranks did not start: " + job.text("err")[-2000:])


def _survivor_and_victim(nodes: list[Job]) -> tuple[Job, Job, list[int], str]:
    """(the node of torchrun's group rank 0, the other one, the other one's global ranks, its
    group rank). Group rank 0's agent hosts the ranks' store, so the node killed is the other
    one: the survivors keep the store that says which ranks went silent and where they ran."""
    envs = [_workers(node) for node in nodes]
    group = [{env["GROUP_RANK"] for env in node_envs} for node_envs in envs]
    assert all(len(g) == 1 for g in group), envs
    victim = 0 if group[0] == {"1"} else 1
    ranks = sorted(int(env["RANK"]) for env in envs[victim])
    return nodes[1 - victim], nodes[victim], ranks, group[victim].pop()


def _kill_node(job: Job) -> float:
    """SIGKILL a node's launcher and every process under it; -> when."""
    for pid in [job.proc.pid] + descendants(job.proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def _gpu_node_env(node: int) -> dict:
    """A GPU "node" of this machine: its 2 GPUs, and a host identity of its own, so NCCL
    connects the two nodes over its network transport and the lost-host line names it."""
    return {"CUDA_VISIBLE_DEVICES": f"{2 * node},{2 * node + 1}",
            "NCCL_HOSTID": f"{socket.gethostname()}-node-{node}"}


needs_4_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow),
                                    pytest.param("cuda", marks=[pytest.mark.multigpu,
                                                                needs_4_gpus])])
def test_the_other_node_names_the_lost_host_and_its_ranks(device):
    """CPU: 2 gloo ranks per node. CUDA: 2 GPUs per node (4 in all), NCCL, each node its own
    NCCL host identity, so the all-to-alls between the nodes go over NCCL's network transport."""
    port = free_port()

    def node(rank: int) -> Job:
        return Job(launcher_cmd(
            "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "host-loss", "--nproc", "2", "--preset", "tiny", "--hidden-size", "64",
            "--seq-length", "64", "--num-microbatches", "2", "--mock-data", "--train-iters",
            "2000", "--log-interval", "1", "--distributed-timeout-minutes", "0.25",
            "--device", device), env=_gpu_node_env(rank) if device == "cuda" else None)
    first = node(0)
    _wait_for_listener(port, first)
    nodes = [first, node(1)]
    try:
        survivor, victim, ranks, group = _survivor_and_victim(nodes)
        assert survivor.wait_for_line("step    3/2000", 240), survivor.text("err")[-3000:]
        killed = _kill_node(victim)
        code = survivor.finish(timeout_s=60)
        took = time.monotonic() - killed
    finally:
        for job in nodes:
            if job.proc.poll() is None:
                job.proc.kill()
    text = survivor.text("out") + "\n" + survivor.text("err")
    assert code != 0 and took < 60, (code, took, text[-3000:])
    assert f"(node {group}) lost (all its ranks: {ranks_text(ranks)})" in text, text[-4000:]


def _torchrun_node(port: int, out: Path, device: str, node: int) -> Job:
    """One "node" of 2 ranks (gloo, or 2 GPUs of their own): torchrun with the c10d rendezvous
    and --max-restarts 1, saving every 2 steps and resuming from the newest checkpoint."""
    ckpt = str(out / "ckpt")
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if device == "cuda":
        env.update(_gpu_node_env(node))
    return Job([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                "--nproc-per-node=2", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=host-loss-restart",
                "--max-restarts=1", "-m", "epoverlap.train", "--preset", "tiny",
                "--hidden-size", "64", "--seq-length", "64", "--num-microbatches", "2",
                "--mock-data", "--train-iters", "40", "--log-interval", "1",
                "--distributed-timeout-minutes", "0.25", "--save", ckpt, "--save-interval",
                "2", "--load", ckpt, "--device", device], env=env)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow),
                                    pytest.param("cuda", marks=[pytest.mark.multigpu,
                                                                needs_4_gpus])])
def test_after_a_lost_node_comes_back_the_job_resumes_from_the_last_checkpoint(tmp_path,
                                                                                device):
    """The surviving node's torchrun restarts its ranks (--max-restarts 1) and waits at the
    rendezvous; a new node joins in place of the lost one; both resume from the newest
    checkpoint and finish."""
    port = free_port()
    first = _torchrun_node(port, tmp_path, device, 0)
    _wait_for_listener(port, first)
    nodes = [first, _torchrun_node(port, tmp_path, device, 1)]
    try:
        survivor, victim, ranks, _ = _survivor_and_victim(nodes)
        assert survivor.wait_for_line("checkpoint: saved", 240), survivor.text("err")[-3000:]
        assert survivor.wait_for_line("step    5/40", 120), survivor.text("err")[-3000:]
        _kill_node(victim)
        lost = f"lost (all its ranks: {ranks_text(ranks)})"
        assert survivor.wait_for_line(lost, 60), survivor.text("err")[-3000:]
        nodes.append(_torchrun_node(port, tmp_path, device, nodes.index(victim)))
        assert survivor.finish(timeout_s=300) == 0, survivor.text("err")[-3000:]
        assert nodes[-1].finish(timeout_s=60) == 0, nodes[-1].text("err")[-3000:]
    finally:
        for job in nodes:
            if job.proc.poll() is None:
                job.proc.kill()
    # rank 0 prints, on whichever node the second rendezvous made group rank 0
    after = survivor.text("out") + nodes[-1].text("out")
    assert "checkpoint: resuming from" in after and "step   40/40" in after, after[-3000:]
