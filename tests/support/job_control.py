"""Run a launcher job as a subprocess and act on its ranks: the rank processes found by their
RANK environment variable, stdout/stderr lines read as they come with their arrival times.
(For the liveness tests: stop or kill one rank mid-step, time how the others exit.)"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]


# NVLink multicast stays off on shared GPU hosts (see tests/training/test_gpu.py).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def job_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **NO_MULTICAST)
    env.pop("TRITON_INTERPRET", None)
    return env


class Job:
    """A command whose output lines are collected with their arrival times."""

    def __init__(self, cmd: list[str], env: Optional[dict] = None):
        """`env`: variables added to `job_env()`."""
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**job_env(), **(env or {})}, cwd=REPO)
        self.lines: "queue.Queue[tuple[float, str, str]]" = queue.Queue()
        self.seen: list[tuple[float, str, str]] = []
        for name, stream in (("out", self.proc.stdout), ("err", self.proc.stderr)):
            threading.Thread(target=self._read, args=(name, stream), daemon=True).start()

    def _read(self, name, stream):
        for line in stream:
            self.lines.put((time.monotonic(), name, line.rstrip("\n")))

    def wait_for_line(self, text: str, timeout_s: float) -> Optional[tuple[float, str, str]]:
        """The first line containing `text` (already seen or arriving within timeout_s)."""
        for entry in self.seen:
            if text in entry[2]:
                return entry
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                entry = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    return None
                continue
            self.seen.append(entry)
            if text in entry[2]:
                return entry
        return None

    def finish(self, timeout_s: float) -> int:
        """Wait for the job's exit; collect every remaining line."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        time.sleep(0.3)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return code

    def text(self, stream: str) -> str:
        return "\n".join(line for _, name, line in self.seen if name == stream)


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Every process under `pid`, at any depth."""
    found = []
    for child in children(pid):
        found += [child] + descendants(child)
    return found


def environ(pid: int) -> dict[str, str]:
    """A process's environment ({} when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def rank_pid(launcher_pid: int, rank: int) -> Optional[int]:
    """The process under `launcher_pid` whose environment has RANK=<rank>."""
    for pid in children(launcher_pid):
        if environ(pid).get("RANK") == str(rank):
            return pid
    return None


def has_exited(pid: int) -> bool:
    """Gone, or a zombie not reaped yet."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def wait_exit(pid: int, timeout_s: float) -> Optional[float]:
    """Monotonic time when `pid` was first seen exited, or None after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if has_exited(pid):
            return time.monotonic()
        time.sleep(0.1)
    return None


def launcher_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "epoverlap.cli.launch", *flags]
