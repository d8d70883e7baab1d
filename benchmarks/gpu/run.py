"""Run GPU recipes (benchmarks/gpu/recipes.py) and pack each one's record.

    python -m benchmarks.gpu.run RECIPE [RECIPE ...] [--out DIR] [--time-limit S] [--dry-run]
    python -m benchmarks.gpu.run --list

Run from the repo root of a copy of the tree on a GPU machine. It first makes the machine
ready: `pip install --no-deps --no-build-isolation -e .` (torch is there already; the machines
reach no package registry) and the wheels carried in .whl/ into /tmp/site, put on PYTHONPATH
(--no-install skips both). Then it runs each recipe's steps in order, under bash, with NVLink
multicast off (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1) and
CUDA_VISIBLE_DEVICES set to the recipe's GPUs (the first of those the caller's
CUDA_VISIBLE_DEVICES names, if set: two runners on two GPUs of one machine, each with its own
--work, run side by side); a recipe that needs more GPUs than are visible,
or a carried file that is not there, is skipped and packs nothing. Each recipe's folder (every
step's log, record.json: the GPUs from nvidia-smi, the date, torch/CUDA/NCCL/triton versions,
the code (`tree_state`: the commit, whether the tree was dirty, the sha256 of its diff), each
step's exact command, environment additions, NCCL settings, exit status and seconds; tree.diff,
the diff itself, where the tree was dirty; and what its commands wrote) is packed into
OUT/RECIPE.tgz; OUT/summary.md gets the table printed last. --dry-run installs and runs
nothing: each recipe named gets its folder, record (steps with no exit status) and pack, on any
machine (a recipe this one could not run says so in its status).
OUT is --out, else $OUT (what the GPU machines send back: at most 8 files of 16 MiB), else
runs/gpu. --time-limit (default 570 s, one device call's 600 s less packing) cuts each step's
limit to what is left and starts no step with less than 20 s left.
Exit status: 0 every recipe ok or skipped (or dry run), 1 one failed, 2 an unknown recipe
(nothing run).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from benchmarks.gpu import recipes as table

REPO = Path(__file__).resolve().parents[2]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
SITE = "/tmp/site"  # where the carried wheels go
RETURN_LIMIT = 16 * 2**20  # bytes per file the GPU machines send back
PROBE = """import json, platform, torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                  "triton": triton_version, "python": platform.python_version(),
                  "gpus": torch.cuda.device_count()}))"""


def _quiet(cmd: list, log: Path, env: dict) -> bool:
    with open(log, "a") as out:
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                              cwd=REPO).returncode == 0


def visible_devices(env: dict, gpus: int) -> str:
    """The recipe's GPUs: the first `gpus` of the caller's CUDA_VISIBLE_DEVICES, else 0..gpus-1."""
    given = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return ",".join(given[:gpus] if given else map(str, range(gpus)))


def prepare(env: dict, work: Path, install: bool) -> str:
    """Install the project and the carried wheels; PYTHONPATH gets the tree (and /tmp/site)."""
    paths = [str(REPO)]
    notes = []
    if install:
        log = work / "install.log"
        ok = _quiet([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                     "--no-build-isolation", "-e", "."], log, env)
        notes.append("project installed" if ok else f"project install failed (see {log})")
        wheels = sorted(glob.glob(str(REPO / ".whl" / "*.whl")))
        if wheels:
            ok = _quiet([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                         "--upgrade", "--target", SITE, *wheels], log, env)
            notes.append(f"{len(wheels)} wheel(s) into {SITE}" + ("" if ok else ": failed"))
            paths.append(SITE)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    return "; ".join(notes) or "no install (--no-install)"


def machine(env: dict) -> dict:
    """The GPUs (nvidia-smi), the date and the versions every record carries."""
    found = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                           env=env, cwd=REPO)
    info = (json.loads(found.stdout) if found.returncode == 0
            else {"gpus": 0, "probe_error": found.stderr[-500:]})
    smi = shutil.which("nvidia-smi")
    query = [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    gpus = subprocess.run(query, capture_output=True, text=True) if smi else None
    info["nvidia_smi"] = gpus.stdout.strip().splitlines() if gpus and gpus.returncode == 0 else []
    info["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return info


@dataclass(frozen=True)
class Tree:
    """The code a run ran: `record` (record.json's "code") and `diff` (tree.diff's bytes)."""

    record: dict
    diff: bytes = b""

    def text(self) -> str:
        """One line for the summary: `1a2b3c4d5e6f (dirty, diff sha256 0f1e2d3c4b5a)`."""
        code = self.record
        if code["commit"] == UNKNOWN:
            return f"unknown ({code['reason']})"
        state = f"dirty, diff sha256 {code['diff_sha256'][:12]}" if code["dirty"] else "clean"
        return f"{code['commit'][:12]} ({state})"


UNKNOWN = "unknown"
DIFF_FILE = "tree.diff"


class _NoGit(Exception):
    """git cannot say what the tree is (no usable .git, no git): the reason, in one line."""


def _git(repo: Path, *args: str, differ_ok: bool = False) -> bytes:
    """git's output in `repo` (bytes, as git wrote them); raises _NoGit with git's own words.
    `differ_ok`: exit status 1 is an answer (`diff --no-index`: the files differ)."""
    try:
        done = subprocess.run(["git", "-c", "core.quotePath=true", *args], cwd=repo,
                              capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as error:
        raise _NoGit(f"git {args[0]}: {error}") from None
    if done.returncode == 0 or (differ_ok and done.returncode == 1):
        return done.stdout
    said = done.stderr.decode(errors="replace").strip().splitlines()
    raise _NoGit(f"git {args[0]}: {said[0] if said else f'exit status {done.returncode}'}")


def _diff(repo: Path) -> tuple:
    """(the diff against HEAD: tracked changes, then each untracked file git does not ignore
    as a new file, in byte order of its path; untracked count). `git apply` takes it."""
    plain = ("--binary", "--no-color", "--no-ext-diff", "--no-textconv", "--src-prefix=a/",
             "--dst-prefix=b/")
    tracked = _git(repo, "diff", *plain, "HEAD", "--")
    listed = _git(repo, "ls-files", "--others", "--exclude-standard", "-z")
    untracked = sorted(name for name in listed.split(b"\0") if name)
    added = [_git(repo, "diff", "--no-index", *plain, "--", os.devnull, os.fsdecode(name),
                  differ_ok=True) for name in untracked]
    return tracked + b"".join(added), len(untracked)


def tree_state(repo: Path) -> Tree:
    """The commit (git HEAD), whether the tree differs from it (tracked changes, or untracked
    files git does not ignore), and the sha256 of that diff; "unknown", with git's reason,
    where git cannot tell (a copy without its .git, no git, `repo` inside another repo)."""
    try:
        top = Path(os.fsdecode(_git(repo, "rev-parse", "--show-toplevel").strip()))
        if top.resolve() != repo.resolve():
            raise _NoGit(f"{repo} is not a git tree's root (its repository is {top})")
        commit = _git(repo, "rev-parse", "--verify", "HEAD").decode().strip()
        diff, untracked = _diff(repo)
    except _NoGit as error:
        return Tree({"commit": UNKNOWN, "dirty": UNKNOWN, "diff_sha256": UNKNOWN,
                     "reason": str(error)})
    return Tree({"commit": commit, "dirty": bool(diff),
                 "diff_sha256": hashlib.sha256(diff).hexdigest(), "diff_bytes": len(diff),
                 "untracked_files": untracked, "diff": DIFF_FILE if diff else None}, diff)


def _stat(pid: int) -> Optional[list]:
    """The fields of /proc/PID/stat after the command name (state first, then the parent),
    None where the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _descendants(pid: int) -> list:
    """Every process under `pid` now (from /proc): torchrun starts its workers in sessions of
    their own, so killing the step's group alone would leave them holding the GPUs."""
    parents = {}
    for entry in glob.glob("/proc/[0-9]*"):
        child = int(entry.rsplit("/", 1)[1])
        fields = _stat(child)
        if fields is not None:
            parents.setdefault(int(fields[1]), []).append(child)
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _signal_all(pids: list, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _alive(pids: list) -> bool:
    """Whether any of `pids` still runs (a zombie has exited: its memory is freed)."""
    return any((fields := _stat(pid)) is not None and fields[0] != "Z" for pid in pids)


def stop_tree(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the step and every process under it (torchrun then stops its workers), SIGKILL
    what is left after `grace_s`, and return once none of them runs."""
    tree = [proc.pid] + _descendants(proc.pid)
    _signal_all(tree, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(tree):
        time.sleep(0.2)
    _signal_all(tree + _descendants(proc.pid), signal.SIGKILL)
    proc.wait()
    while _alive(tree):
        time.sleep(0.2)


def run_step(command: str, env: dict, log: Path, timeout: float) -> int:
    """One step under bash, output to its log; past its limit it and every process under it
    are stopped (stop_tree): 124."""
    with open(log, "w") as out:
        out.write(f"$ {command}\n")
        out.flush()
        proc = subprocess.Popen(["bash", "-c", command], stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=REPO, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_tree(proc)
            return 124


def why_skipped(recipe, visible: int):
    if visible < recipe.gpus:
        return f"skipped: needs {recipe.gpus} GPU(s), {visible} visible"
    missing = [pattern for pattern in recipe.needs if not glob.glob(str(REPO / pattern))]
    return f"skipped: needs {', '.join(missing)} (not carried)" if missing else None


def run_recipe(recipe, env: dict, info: dict, work: Path, out: Path, deadline: float,
               tree: Tree, dry_run: bool = False) -> dict:
    status, start = why_skipped(recipe, info["gpus"]), time.time()
    if status is not None and not dry_run:  # nothing to pack: the summary says why
        return {"recipe": recipe.name, "status": status, "seconds": 0.0, "record": "-"}
    if dry_run:
        status = "dry run" + (f" (here it would be {status})" if status else "")
    folder = work / recipe.name
    shutil.rmtree(folder, ignore_errors=True)  # a warm machine keeps the last call's files
    folder.mkdir(parents=True)
    if tree.diff:
        (folder / DIFF_FILE).write_bytes(tree.diff)
    gpus = max(info["gpus"], recipe.gpus) if recipe.all_gpus else recipe.gpus
    scratch = work / f"{recipe.name}.scratch"  # large files that are not sent back
    shutil.rmtree(scratch, ignore_errors=True)
    names = {"python": sys.executable, "gpus": gpus, "out": folder, "scratch": scratch,
             "torchrun": f"{sys.executable} -m torch.distributed.run --standalone "
                         f"--nproc-per-node={gpus}"}
    record = {"recipe": recipe.name, "measures": recipe.measures, "records": recipe.records,
              "gpus": gpus, "code": tree.record, "machine": info, "steps": []}
    for step in recipe.steps:
        step_env = {key: value.format(**names) for key, value in step.env.items()}
        command = step.command.format(**names)
        full_env = {**env, **step_env}
        if gpus:
            full_env["CUDA_VISIBLE_DEVICES"] = visible_devices(env, gpus)
        left = deadline - time.time()
        entry = {"name": step.name, "command": command, "env": step_env,
                 "nccl_env": {key: value for key, value in sorted(full_env.items())
                              if key.startswith(("NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_"))},
                 "log": f"{step.name}.log"}
        record["steps"].append(entry)
        if dry_run:
            entry["rc"] = None
            continue
        if left < 20:
            entry["rc"], status = None, f"cut: time limit before {step.name}"
            break
        print(f"=== {recipe.name}/{step.name}: {command}", flush=True)
        step_start = time.time()
        rc = run_step(command, full_env, folder / entry["log"], min(step.timeout_s, left - 10))
        entry.update(rc=rc, seconds=round(time.time() - step_start, 1))
        print(f"{recipe.name}/{step.name}: rc={rc} ({entry['seconds']} s)", flush=True)
        if rc != 0:
            tail = (folder / entry["log"]).read_text(errors="replace").splitlines()[-15:]
            print("\n".join("    " + line for line in tail), flush=True)
            status = status or (f"timeout: {step.name}" if rc == 124
                                else f"failed: {step.name} rc={rc}")
    record["status"] = status or "ok"
    record["seconds"] = round(time.time() - start, 1)
    (folder / "record.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    packed = out / f"{recipe.name}.tgz"
    with tarfile.open(packed, "w:gz") as tar:
        tar.add(folder, arcname=recipe.name)
    if packed.stat().st_size > RETURN_LIMIT:
        record["status"] += f"; {packed.name} is over 16 MiB: it will not come back"
    return {"recipe": recipe.name, "status": record["status"], "seconds": record["seconds"],
            "record": str(packed)}


def summary(rows: list, info: dict, setup: str, tree: Tree) -> str:
    lines = [f"GPUs: {', '.join(info['nvidia_smi']) or 'none'} | date {info['date']} | "
             f"torch {info.get('torch')} (CUDA {info.get('cuda')}) | NCCL {info.get('nccl')} | "
             f"triton {info.get('triton')} | python {info.get('python')} | "
             f"commit {tree.text()} | {setup}", "",
             "| recipe | status | seconds | record |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['recipe']} | {r['status']} | {r['seconds']} | {r['record']} |" for r in rows]
    return "\n".join(lines) + "\n"


def list_recipes(recipes) -> str:
    lines = []
    for recipe in recipes:
        gpus = f"{recipe.gpus}+ GPUs (all visible)" if recipe.all_gpus else f"{recipe.gpus} GPU(s)"
        needs = f"; needs {', '.join(recipe.needs)}" if recipe.needs else ""
        lines += [f"{recipe.name}: {gpus}{needs}", f"    measures: {recipe.measures}",
                  f"    records: {recipe.records}"]
    return "\n".join(lines)


def main(argv=None, recipes=None) -> int:
    recipes = table.RECIPES if recipes is None else recipes
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipes", nargs="*", metavar="RECIPE")
    parser.add_argument("--list", action="store_true", help="list the recipes and exit")
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu")
    parser.add_argument("--work", default="/tmp/epoverlap-gpu",
                        help="where the records are made before packing")
    parser.add_argument("--time-limit", type=float, default=570.0)
    parser.add_argument("--no-install", action="store_true")
    parser.add_argument("--dry-run", action="store_true",
                        help="install and run nothing: write and pack each recipe's record")
    args = parser.parse_args(argv)
    if args.list:
        print(list_recipes(recipes))
        return 0
    known = {recipe.name: recipe for recipe in recipes}
    unknown = [name for name in args.recipes if name not in known]
    if unknown or not args.recipes:
        what = f"unknown recipe {', '.join(unknown)}" if unknown else "no recipe named"
        print(f"benchmarks.gpu.run: {what} (--list names them)", file=sys.stderr)
        return 2
    deadline = time.time() + args.time_limit
    tree = tree_state(REPO)  # before anything here writes into the tree
    out, work = Path(args.out).resolve(), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    setup = ("dry run: nothing installed or run" if args.dry_run
             else prepare(env, work, not args.no_install))
    info = {**machine(env), "setup": setup}
    rows = [run_recipe(known[name], env, info, work, out, deadline, tree, args.dry_run)
            for name in args.recipes]
    text = summary(rows, info, setup, tree)
    (out / "summary.md").write_text(text)
    print("\n" + text, end="")
    packed = sum(row["record"] != "-" for row in rows) + 1
    if packed > 8:
        print(f"note: {packed} files in {out}; a GPU machine sends back 8")
    failed = [r for r in rows if not r["status"].startswith(("ok", "skipped", "dry run"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
