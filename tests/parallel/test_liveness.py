"""Liveness: a rank that dies or stalls ends the others within the collective timeout, each
with one line naming the step, the process group and the silent rank (parallel/watch.py).

Tiers: pure CPU (the line, the error translation, the comm thread handing the failure to the
main thread, the monitor with a fake heartbeat, SIGTERM with the main thread blocked), gloo
(every group gets the configured timeout; SIGKILL and SIGSTOP of a rank of a 2-rank job with
the overlap on), and NCCL (`multigpu`: SIGKILL under the overlap on 2 GPUs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from epoverlap.model.nodes import COMM, COMPUTE
from epoverlap.parallel.watch import (CollectiveWatch, PeerFailure, ranks_text, short_cause)
from epoverlap.schedule.executor import ThreadLanes
from job_control import REPO, Job, job_env, launcher_cmd, rank_pid, wait_exit

TIMEOUT_MIN = 0.25  # --distributed-timeout-minutes of the job tests: 15 s
TIMEOUT_S = TIMEOUT_MIN * 60
GLOO_CONNECTION_CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                          "closed by peer [127.0.0.1]:18105. This is typically caused by a "
                          "remote worker crashing.")


class FakeHeartbeat:
    """Counters in memory: this rank's moves on every beat; `frozen` ranks never move."""

    def __init__(self, world_size: int, rank: int = 0, frozen=(1,)):
        self.rank, self.frozen = rank, set(frozen)
        self.counts = [0] * world_size
        self.lock = threading.Lock()

    def beat(self):
        with self.lock:
            for r in range(len(self.counts)):
                if r not in self.frozen:
                    self.counts[r] += 1

    def counters(self):
        with self.lock:
            return list(self.counts)

    def hosts(self):
        return None  # no rank published a host


# ------------------------------------------------------------------------------ pure CPU
def test_the_line_names_step_group_op_and_silent_ranks():
    assert ranks_text([0, 1]) == "0,1" and ranks_text([0, 1, 2, 3, 6]) == "0-3,6"
    assert short_cause(RuntimeError(GLOO_CONNECTION_CLOSED)) == \
        "Connection closed by peer [127.0.0.1]:18105"
    failure = PeerFailure(0, 3, "expert-parallel group (ranks 0,1) all_to_all failed (x)",
                          silent=[1], silent_for_s=3.0)
    assert str(failure) == ("rank 0: step 3: expert-parallel group (ranks 0,1) all_to_all "
                            "failed (x): rank 1 did not answer (no heartbeat in the last 3.0 s: "
                            "dead or stopped)")
    alive = PeerFailure(1, 0, "world group (ranks 0-3) all_reduce failed (y)", silent=[])
    assert str(alive).startswith("rank 1: before step 1: world group")
    assert "every peer still sends heartbeats" in str(alive)
    # two torchrun nodes: the dead rank's agent, which hosted the store, left with it
    no_store = PeerFailure(1, 5, "expert-parallel group (ranks 0,1) all_to_all failed (z)",
                           store_answers=False, peers=(0,))
    assert str(no_store).endswith(": rank 0 did not answer (the group's other rank; the "
                                  "rendezvous store is gone too, so no heartbeat tells more)")


def test_collective_turns_a_transport_error_into_a_peer_failure_with_context():
    watch = CollectiveWatch(0, 2, TIMEOUT_S, on_gpu=False)
    watch.step = 7
    with pytest.raises(PeerFailure) as info:
        with watch.collective("expert-parallel", (0, 1), "all_to_all"):
            raise RuntimeError(GLOO_CONNECTION_CLOSED)
    assert str(info.value).startswith(
        "rank 0: step 7: expert-parallel group (ranks 0,1) all_to_all failed (Connection closed "
        "by peer [127.0.0.1]:18105)")
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="Split sizes") as info:  # a caller's bug stays itself
        with watch.collective("world", (0, 1), "all_reduce"):
            raise RuntimeError("Split sizes doesn't match total dim 0 size")
    assert not isinstance(info.value, PeerFailure)
    assert watch.oldest_unfinished() is None  # both calls count as finished



class _FakeBackend:
    """A process group whose all_to_all_single records its arguments or raises `error`."""

    def __init__(self, error=None):
        self.error, self.calls = error, []

    def all_to_all_single(self, output, input, output_splits, input_splits, options):
        self.calls.append((output_splits, input_splits, options.asyncOp))
        if self.error is not None:
            raise self.error
        output.copy_(input)


def test_group_all_to_all_short_path_is_watched_like_every_collective():
    """`Group.all_to_all_single` calls the backend directly (no `dist` wrapper, no generator
    context): it must still pass the splits and a blocking option, turn a transport error
    into the same PeerFailure line as `watch.collective`, and leave nothing in flight."""
    from epoverlap.parallel.groups import Group
    watch = CollectiveWatch(1, 3, TIMEOUT_S, on_gpu=False)
    watch.step = 5
    backend = _FakeBackend()
    group = Group("expert-parallel", (0, 1, 2), backend, watch)
    send, recv = torch.arange(6.0), torch.empty(6)
    group.all_to_all_single(recv, send, [1, 2, 3], [3, 2, 1])
    group.all_to_all_single(recv, send)
    assert backend.calls == [([1, 2, 3], [3, 2, 1], False), ([], [], False)]
    assert torch.equal(recv, send) and watch.oldest_unfinished() is None

    backend.error = RuntimeError(GLOO_CONNECTION_CLOSED)
    with pytest.raises(PeerFailure) as info:
        group.all_to_all_single(recv, send)
    assert str(info.value).startswith(
        "rank 1: step 5: expert-parallel group (ranks 0-2) all_to_all failed (Connection closed")
    assert info.value.peers == (0, 2) and isinstance(info.value.__cause__, RuntimeError)
    backend.error = RuntimeError("Split sizes doesn't match total dim 0 size")
    with pytest.raises(RuntimeError, match="Split sizes") as info:  # a caller's bug stays itself
        group.all_to_all_single(recv, send, [1], [1])
    assert not isinstance(info.value, PeerFailure)
    backend.error = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        group.all_to_all_single(recv, send)
    assert watch.oldest_unfinished() is None  # every failed call counts as finished

def test_comm_thread_failure_reaches_the_main_thread_and_queued_comm_is_cancelled():
    lanes = ThreadLanes()
    failure = PeerFailure(0, 4, "expert-parallel group (ranks 0,1) all_to_all failed (z)")
    release, ran_after = threading.Event(), []

    def fail(wait):
        wait()
        raise failure
    lanes.submit(COMM, 0, fail, chain=True)
    with pytest.raises(PeerFailure) as info:
        lanes.submit(COMPUTE, 0, lambda wait: wait(), chain=True)  # waits on mb 0's comm node
    assert info.value is failure  # the same object: step, group and op cross the threads
    lanes.submit(COMM, 1, lambda wait: release.wait(), chain=True)  # blocked: a silent peer
    lanes.submit(COMM, 1, lambda wait: ran_after.append(1), chain=True)
    started = time.monotonic()
    lanes.abort()  # must not wait for the blocked node
    assert time.monotonic() - started < 1.0
    release.set()
    lanes.close()
    assert ran_after == []  # the queued node was cancelled


def _watch_with(frozen, timeout_s=1.6):
    exits = []
    watch = CollectiveWatch(0, 3, timeout_s, on_gpu=False,
                            heartbeat=FakeHeartbeat(3, frozen=frozen), exit_process=exits.append)
    return watch, exits


def test_monitor_reports_a_stalled_collective_naming_the_silent_peer(capsys):
    watch, exits = _watch_with(frozen=(2,))
    watch.step = 5
    watch.start()
    try:
        with watch.collective("expert-parallel", (0, 1, 2), "all_to_all"):
            deadline = time.monotonic() + 10
            while not exits and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        watch.close()
    assert exits == [3]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("epoverlap-train: error: rank 0: step 5: expert-parallel group "
                               "(ranks 0-2) all_to_all has waited 1 s of its 2 s timeout: "
                               "rank 2 did not answer"), lines


def test_monitor_leaves_a_slow_collective_alone_while_every_peer_beats(capsys):
    watch, exits = _watch_with(frozen=())
    watch.start()
    try:
        with watch.collective("world", (0, 1, 2), "all_reduce"):
            time.sleep(2.5)  # past the 1.6 s timeout: the backend's own timeout decides
    finally:
        watch.close()
    assert exits == [] and capsys.readouterr().err == ""


def test_a_signal_reaches_the_training_loop_before_the_probe_and_a_silent_peer_still_fails():
    """The training loop's stop is asked at once (its flag rides in the next step's reduction,
    not 2 s of probing later); the probe still turns the signal into a silent peer's failure."""
    for frozen, exits_after in (((), []), ((2,), [3])):
        watch, exits = _watch_with(frozen=frozen, timeout_s=8.0)  # a probe window of 2 s
        handed = []
        watch.stop_handler = lambda name: handed.append((name, time.monotonic()))
        started = time.monotonic()
        watch.on_signal(signal.SIGTERM)  # on this thread: returns after the probe
        assert time.monotonic() - started >= watch.timing.window_s * 0.9, frozen
        assert [name for name, _ in handed] == ["SIGTERM"], frozen
        assert handed[0][1] - started < 0.5, frozen
        assert exits == exits_after, frozen


def test_a_run_that_ends_during_the_probe_reports_nothing():
    """Every rank took part in the reduction that agreed on the stop, so all were alive: the
    watch's close ends the probe at once and no failure is reported (the peer's heartbeat
    standing still here would otherwise be one)."""
    watch, exits = _watch_with(frozen=(2,), timeout_s=8.0)
    handed = []
    watch.stop_handler = handed.append
    probing = threading.Thread(target=watch.on_signal, args=(signal.SIGTERM,))
    probing.start()
    time.sleep(0.3)
    closed = time.monotonic()
    watch.close()
    probing.join(timeout=5)
    assert not probing.is_alive() and time.monotonic() - closed < 1.0
    assert handed == ["SIGTERM"] and exits == []


SIGTERM_SCRIPT = textwrap.dedent("""
    import signal, sys, time
    sys.path[:0] = ["tests/parallel", "tests/support"]  # test_liveness imports job_control
    from test_liveness import FakeHeartbeat
    from epoverlap.parallel.watch import CollectiveWatch, route_signals
    watch = CollectiveWatch(0, 2, 900.0, on_gpu=False, heartbeat=FakeHeartbeat(2))
    watch.step = 9
    watch.start()
    route_signals(watch)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # the main thread never takes it
    with watch.collective("expert-parallel", (0, 1), "all_to_all"):
        print("ready", flush=True)
        time.sleep(120)  # as if blocked in C++ behind a stuck NCCL kernel
""")


def test_sigterm_is_reported_by_the_monitor_while_the_main_thread_is_blocked():
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=job_env(), cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "ready"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, err
    assert time.monotonic() - started < 15
    assert err.strip() == (
        "epoverlap-train: error: rank 0: step 9: stopped by SIGTERM while in the expert-parallel "
        "group (ranks 0,1) all_to_all: rank 1 did not answer (no heartbeat in the last "
        f"{err.split('last ')[1].split(' s:')[0]} s: dead or stopped)"), err


def test_every_process_group_gets_the_configured_timeout(monkeypatch):
    import torch.distributed as dist

    from epoverlap.parallel import groups as groups_module
    created = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: created.append((ranks, kw)))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: created.append(("init", kw)))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(groups_module.os, "environ", dict(groups_module.os.environ))
    groups = groups_module.init_distributed(1, "cpu", timeout_minutes=0.25)
    groups.watch.close()
    assert [kw["timeout"].total_seconds() for _, kw in created] == [15.0] * 3
    assert sorted(kw["group_desc"] for ranks, kw in created if ranks != "init") == [
        "expert-data-parallel", "expert-parallel"]


# ------------------------------------------------------------------------------ gloo jobs
QUICK_JOB = ["--nproc", "2", "--hidden-size", "64", "--seq-length", "64",
             "--num-microbatches", "2", "--train-iters", "100000",
             "--distributed-timeout-minutes", str(TIMEOUT_MIN)]


def _signal_mid_step(sig: signal.Signals, victim: int, flags=QUICK_JOB, start_timeout_s=240):
    """Start the main job (the launcher's defaults: EP over both ranks, overlap on), signal
    rank `victim` once step 3 is logged, and time the other rank's exit."""
    job = Job(launcher_cmd(*flags))
    try:
        assert job.wait_for_line("step    3/", start_timeout_s), job.text("err")
        victim_pid = rank_pid(job.proc.pid, victim)
        survivor_pid = rank_pid(job.proc.pid, 1 - victim)
        signalled = time.monotonic()
        os.kill(victim_pid, sig)
        exited = wait_exit(survivor_pid, TIMEOUT_S + 45)
        if sig == signal.SIGSTOP:
            os.kill(victim_pid, signal.SIGKILL)  # spare torchrun's grace period for it
        code = job.finish(60)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    return job, code, (None if exited is None else exited - signalled)


def _check_named(job: Job, code: int, survivor: int, victim: int, status: int):
    err = job.text("err")
    lines = [line for line in err.splitlines() if line.startswith("epoverlap-train: error:")]
    assert len(lines) == 1, err
    assert f"rank {survivor}: step " in lines[0], lines[0]
    assert "group (ranks 0,1)" in lines[0], lines[0]
    assert f"rank {victim} did not answer" in lines[0], lines[0]
    assert "Traceback" not in err, err
    assert code == status, (code, err)  # the launcher returns the first failed rank's status
    return lines[0]


@pytest.mark.slow
def test_killed_rank_is_named_by_the_other_within_the_timeout():
    job, code, after_s = _signal_mid_step(signal.SIGKILL, victim=0)
    assert after_s is not None and after_s <= TIMEOUT_S + 15, after_s
    _check_named(job, code, survivor=1, victim=0, status=128 + signal.SIGKILL)


@pytest.mark.slow
def test_stopped_rank_is_named_by_the_other_within_the_timeout():
    job, code, after_s = _signal_mid_step(signal.SIGSTOP, victim=1)
    assert after_s is not None and TIMEOUT_S / 2 <= after_s <= TIMEOUT_S + 15, after_s
    # (not before: a stopped peer may be resumed; the timeout is how long it is waited for)
    line = _check_named(job, code, survivor=0, victim=1, status=3)
    assert any(f"{group} group (ranks 0,1)" in line
               for group in ("expert-parallel", "expert-parallel split sizes", "world")), line


# ------------------------------------------------------------------------------ NCCL
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs")
def test_nccl_killed_rank_is_named_by_the_other_within_60_s():
    """2 GPUs, NCCL, overlap on (the launcher's defaults, bf16): SIGKILL rank 1 mid-step; rank
    0 exits within 60 s with one line naming rank 1 (timeout 0.5 min)."""
    flags = ["--nproc", "2", "--train-iters", "100000", "--distributed-timeout-minutes", "0.5"]
    job, code, after_s = _signal_mid_step(signal.SIGKILL, victim=1, flags=flags,
                                          start_timeout_s=300)
    assert after_s is not None and after_s <= 60, (after_s, job.text("err"))
    _check_named(job, code, survivor=0, victim=1, status=128 + signal.SIGKILL)
