"""Stops as a scheduler or a user makes them (2 CPU ranks, gloo): SIGTERM or SIGINT to the
launcher, or to every process at once, stops every rank after the same step (the step in
progress or the next), saves it with --exit-signal-handler, says in one line which step the last
checkpoint holds and exits 143 (130) with no "did not answer" line, the launcher within 3 s of
that step; a resume from that checkpoint continues bit for bit. Ctrl-C during start-up ends the
job with at most 3 lines naming SIGINT. A stopped
rank ends the job within the timeout plus the launcher's grace. --exit-interval and
--exit-duration-in-mins stop the same way in process; an unwritable --save stops the launcher
before any rank starts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
import torch

from dist_helpers import single_rank_groups
from epoverlap.config import parse_config
from epoverlap.training.loop.trainer import Trainer
from job_control import REPO, Job, job_env, launcher_cmd, rank_pid, wait_exit

QUICK = ["--hidden-size", "64", "--seq-length", "64", "--num-microbatches", "4",
         "--lr-warmup-iters", "2"]
STOP_LINE = re.compile(r"^stopped by (SIGTERM|SIGINT) after step (\d+) of 100; the last "
                       r"checkpoint holds step (\d+) \((.+)\)$")


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


STEP_LINE = re.compile(r"^step\s+(\d+)/")


def _stopped_job(tmp_path, send, flags=QUICK, exit_within_s=3.0) -> tuple[Job, int, int]:
    """The main job with --exit-signal-handler, stopped by `send(job)` once step 3 is logged:
    after the step in progress or the next one (the stop flag rides in the step's reduction;
    its line within 1 s of the signal), and the launcher exits within `exit_within_s` of that
    step's line (the save included).
    -> (job, exit status, the step the stop line names)."""
    job = Job(launcher_cmd("--nproc", "2", *flags, "--train-iters", "100",
                           "--exit-signal-handler", "--save", str(tmp_path / "ckpt"),
                           "--log-json", str(tmp_path / "run.jsonl")))
    try:
        assert job.wait_for_line("step    3/", 240), job.text("err")
        send(job)
        sent = time.monotonic()  # every signal is out (`send` may look up the ranks first)
        code = job.proc.wait(90)
        exited = time.monotonic()
        job.finish(5)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    err = job.text("err")
    assert "did not answer" not in err and "Traceback" not in err, err
    stops = [m for m in map(STOP_LINE.match, job.text("out").splitlines()) if m]
    assert len(stops) == 1, job.text("out")
    step, held = int(stops[0].group(2)), int(stops[0].group(3))
    assert step == held and step >= 3, stops[0].group(0)
    steps = {int(m.group(1)): t for t, name, line in job.seen
             if name == "out" and (m := STEP_LINE.match(line))}
    at_signal = max(n for n, t in steps.items() if t <= sent)
    # The stop step's line within 1 s of the signal (before: about 3 s). Measured outside
    # pytest the stop came 1-2 steps after the signal (benchmarks/data/signal_stops_cpu_2026-11-29);
    # here the lines reach the test through pipes read by threads on a 2-core host, so the
    # last step the test saw before the signal lags by up to 5 of these ~0.1 s steps: a step
    # count is not checked, the time is.
    assert steps[step] - sent < 1.0, (steps[step] - sent, at_signal, step)
    assert step >= at_signal, (at_signal, step)  # not before the signal
    assert exited - steps[step] < exit_within_s, (exited - steps[step], job.text("out"))
    assert (tmp_path / "ckpt" / f"iter_{step:07d}" / "meta.json").is_file()
    return job, code, step


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_the_step_and_a_resume_continues_bitwise(tmp_path):
    job, code, step = _stopped_job(tmp_path, lambda job: job.proc.send_signal(signal.SIGTERM))
    assert code == 143, job.text("err")
    stopped = _records(tmp_path / "run.jsonl")
    assert [r["step"] for r in stopped] == list(range(1, step + 1))
    end = step + 2  # both runs below keep --train-iters 100 (its schedule) and stop at `end`
    resumed = subprocess.run(
        launcher_cmd("--nproc", "2", *QUICK, "--train-iters", "100", "--exit-interval",
                     str(end), "--load", str(tmp_path / "ckpt"), "--log-json",
                     str(tmp_path / "resumed.jsonl")),
        capture_output=True, text=True, env=job_env(), cwd=REPO, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    whole = subprocess.run(
        launcher_cmd("--nproc", "2", *QUICK, "--train-iters", "100", "--exit-interval",
                     str(end), "--log-json", str(tmp_path / "whole.jsonl")),
        capture_output=True, text=True, env=job_env(), cwd=REPO, timeout=300)
    assert whole.returncode == 0, whole.stderr
    def bits(name):
        return [(r["step"], r["loss_hex"], r["grad_norm_hex"])
                for r in _records(tmp_path / name) if r["step"] > step]
    assert [entry[0] for entry in bits("resumed.jsonl")] == [step + 1, step + 2]
    assert bits("resumed.jsonl") == bits("whole.jsonl")


@pytest.mark.slow
def test_sigint_to_the_launcher_stops_with_status_130(tmp_path):
    job, code, _ = _stopped_job(tmp_path, lambda job: job.proc.send_signal(signal.SIGINT))
    assert code == 130, job.text("err")


@pytest.mark.slow
def test_sigterm_to_every_process_at_once_as_a_scheduler_sends_it(tmp_path):
    def everyone(job):
        for pid in [rank_pid(job.proc.pid, rank) for rank in (0, 1)] + [job.proc.pid]:
            os.kill(pid, signal.SIGTERM)
    job, code, _ = _stopped_job(tmp_path, everyone)
    assert code == 143, job.text("err")


def _ranks_up(job: Job, timeout_s: float) -> list[int]:
    """Both ranks' process ids, once torchrun has started them (still in their start-up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [rank_pid(job.proc.pid, rank) for rank in (0, 1)]
        if all(pids):
            return pids
        time.sleep(0.05)
    raise AssertionError(f"no ranks after {timeout_s} s: {job.text('err')}")


@pytest.mark.slow
def test_ctrl_c_during_start_up_ends_the_job_with_one_line_naming_sigint():
    """Ctrl-C reaches the terminal's foreground process group: the launcher (torchrun starts
    the ranks in sessions of their own, and forwards the signal to them). While the launcher
    loads and checks the flags, and while the ranks load theirs: status 130, at most 3 lines
    (the launcher's plan line aside), each naming SIGINT, no traceback, no rank left."""
    for when in ("launcher", "ranks"):
        job = Job(launcher_cmd("--nproc", "2", *QUICK, "--train-iters", "100"))
        try:
            if when == "launcher":
                time.sleep(0.5)
                pids = []
            else:
                pids = _ranks_up(job, 240)
            job.proc.send_signal(signal.SIGINT)
            code = job.finish(60)
        finally:
            if job.proc.poll() is None:
                job.proc.kill()
        lines = [line for _, _, line in job.seen if "torchrun --standalone" not in line]
        assert code == 130, (when, lines)
        assert 1 <= len(lines) <= 3, (when, lines)
        assert all("stopped by SIGINT before" in line for line in lines), (when, lines)
        assert all(wait_exit(pid, 10) is not None for pid in pids), when


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs")
def test_nccl_sigterm_to_the_launcher_saves_the_step_and_exits_143(tmp_path):
    """2 GPUs, NCCL, the launcher's GPU defaults (bf16, partial CUDA graphs, overlap)."""
    job, code, step = _stopped_job(tmp_path, lambda job: job.proc.send_signal(signal.SIGTERM),
                                   flags=[], exit_within_s=10.0)  # a bigger save, NCCL's end
    assert code == 143, job.text("err")
    assert [r["step"] for r in _records(tmp_path / "run.jsonl")] == list(range(1, step + 1))


TIMEOUT_MIN = 0.25  # 15 s: the collective timeout of the stopped-rank job


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_timeout_plus_the_launchers_grace():
    job = Job(launcher_cmd("--nproc", "2", *QUICK, "--train-iters", "100000",
                           "--distributed-timeout-minutes", str(TIMEOUT_MIN)))
    try:
        assert job.wait_for_line("step    3/", 240), job.text("err")
        victim = rank_pid(job.proc.pid, 1)
        stopped = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        code = job.finish(120)
        took = time.monotonic() - stopped
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert code == 3, job.text("err")
    assert "rank 1 did not answer" in job.text("err")
    assert took <= 60 * TIMEOUT_MIN + 5 + 10, took  # the launcher's 5 s grace, 10 s margin


def _trainer(tmp_path, *flags: str) -> Trainer:
    argv = ["--preset", "tiny", "--hidden-size", "32", "--seq-length", "32", "--mock-data",
            "--train-iters", "6", "--save", str(tmp_path / "ckpt"), *flags]
    return Trainer(parse_config(argv), single_rank_groups(), log=lambda msg: None)


def test_exit_interval_stops_after_its_step_with_a_checkpoint(tmp_path):
    trainer = _trainer(tmp_path, "--exit-interval", "2")
    try:
        assert [r.step for r in trainer.train()] == [1, 2]
        assert trainer.stopped_by == "exit interval"
        assert trainer.parts.checkpointer.last_saved[0] == 2
    finally:
        trainer.close()


def test_exit_duration_stops_after_the_step_that_passes_it(tmp_path):
    trainer = _trainer(tmp_path, "--exit-duration-in-mins", "1e-9")
    try:
        assert [r.step for r in trainer.train()] == [1]
        assert trainer.stopped_by == "time limit"
        assert (tmp_path / "ckpt" / "iter_0000001").is_dir()
    finally:
        trainer.close()


def test_an_unwritable_save_stops_the_launcher_before_any_rank_starts():
    started = time.monotonic()
    result = subprocess.run(launcher_cmd("--save", "/proc/nope"), capture_output=True,
                            text=True, env=job_env(), cwd=REPO, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "epoverlap-launch: error: --save=/proc/nope: cannot create a file in /proc ("), lines
    assert time.monotonic() - started < 60
