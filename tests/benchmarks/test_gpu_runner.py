"""benchmarks/gpu: the recipe table (what every GPU check runs) and its runner, on CPU: the
table names modules, test paths and shapes that exist under unique names, covers the checks
the project relies on, formats, and its training commands pass the config's rules; the runner
lists, refuses an unknown recipe in one line, and runs stubbed recipes: status, record and pack
under --out; a dry run records the code (commit, dirty flag, diff hash) of a git tree, and
"unknown" with the reason where there is no usable git."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks.gpu import recipes, run
from benchmarks.gpu.recipes import Recipe, Step
from epoverlap.config.parse import parse_config
from epoverlap.config import validate
from epoverlap.config.resolve import validate_config
from epoverlap.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
MODULE = re.compile(r"-m ((?:benchmarks|epoverlap)\.[\w.]+)")
TEST_PATH = re.compile(r"(?<![\w/])(tests(?:/[\w./]+)?)(?![\w/])")
SHAPES = re.compile(r"--shapes (\S+)")
NAMES = {"python": "PY", "torchrun": "TR", "gpus": 2, "out": "/o", "scratch": "/s"}


def _commands(recipe: Recipe) -> list:
    return [step.command for step in recipe.steps]


def _by_name() -> dict:
    return {recipe.name: recipe for recipe in recipes.RECIPES}


def test_names_are_unique_and_say_what_is_measured_not_when():
    names = [recipe.name for recipe in recipes.RECIPES]
    assert len(names) == len(set(names))
    for name in names:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        assert not re.search(r"\d{4}|call|issue|run\d|_v\d|merged|again", name), name


def test_every_recipe_names_modules_and_test_paths_that_exist():
    for recipe in recipes.RECIPES:
        named = []
        for command in _commands(recipe):
            for module in MODULE.findall(command):
                path = REPO / module.replace(".", "/")
                assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), (
                    recipe.name, module)
                named.append(module)
            for test_path in TEST_PATH.findall(command):
                assert (REPO / test_path).exists(), (recipe.name, test_path)
                named.append(test_path)
        assert named, f"{recipe.name} names no harness module, CLI module or test path"


def _benchmark_shapes() -> set:
    """bench_overlap's SHAPES keys, read from its source (no torch, no model import)."""
    tree = ast.parse((REPO / "benchmarks" / "harness" / "bench_overlap.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["SHAPES"]:
            return {key.value for key in node.value.keys}
    raise AssertionError("no SHAPES in bench_overlap.py")


def test_every_shape_a_recipe_names_is_a_benchmark_shape():
    known = _benchmark_shapes()
    assert "megatron_e32_k4_mbs2x8" in known
    for recipe in recipes.RECIPES:
        for command in _commands(recipe):
            if "bench_overlap" in command or "bench_peer" in command:
                for shapes in SHAPES.findall(command):
                    assert set(shapes.split(",")) <= known, (recipe.name, shapes)


def test_every_command_and_env_value_formats_with_the_runners_names():
    for recipe in recipes.RECIPES:
        assert recipe.gpus >= 1 and recipe.steps and recipe.measures and recipe.records
        steps = [step.name for step in recipe.steps]
        assert len(steps) == len(set(steps)), recipe.name  # one log per step
        for step in recipe.steps:
            assert "{" not in step.command.format(**NAMES), (recipe.name, step.name)
            if "-m pytest" in step.command:  # its own -m replaces the default 'not slow'
                assert step.command.count(" -m ") == 2, (recipe.name, step.name)
            for value in step.env.values():
                value.format(**NAMES)
            assert 0 < step.timeout_s < 600  # one device call's limit


def test_the_table_covers_the_checks_the_project_relies_on():
    table = _by_name()
    one, rest = table["gpu_tests_1gpu"], table["gpu_tests_1gpu_training"]
    assert one.gpus == rest.gpus == 1
    assert "-m 'gpu and not multigpu' --ignore tests/training tests" in one.steps[0].command
    assert rest.steps[0].command.endswith("-m 'gpu and not multigpu' tests/training")
    multi = table["gpu_tests_multigpu"]
    assert multi.gpus >= 2 and "-m multigpu" in multi.steps[0].command
    assert "benchmarks.harness.check_bitwise" in table["bitwise_check"].steps[0].command
    cli = " ".join(_commands(table["bitwise_cli"]))
    assert "--bf16" in cli and "--deterministic-mode" in cli and "--skip-optimizer" not in cli
    assert cli.count("epoverlap.cli.compare_losses") == 3
    for name, p2p in (("overlap_step_nvlink", None), ("overlap_step_nop2p", "1")):
        [step] = table[name].steps
        assert "benchmarks.harness.bench_overlap" in step.command
        assert recipes.MEGATRON_SHAPES in step.command
        assert step.env.get("NCCL_P2P_DISABLE") == p2p
    peer = table["peer_megatron_core"]
    assert "benchmarks.harness.bench_peer" in " ".join(_commands(peer))
    assert any("megatron_core" in need for need in peer.needs)
    assert "benchmarks.harness.bench_kernels" in " ".join(_commands(table["kernel_speed"]))
    [rounds] = table["train_step_schedules"].steps
    assert "benchmarks.harness.bench_train_rounds" in rounds.command
    assert int(re.search(r"--rounds (\d+)", rounds.command).group(1)) >= 3
    assert "-m epoverlap.train" in rounds.command.split(" -- ")[1]


def test_list_names_every_recipe():
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu.run", "--list"],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    listed = re.findall(r"^(\w+): ", result.stdout, re.M)
    assert listed == [recipe.name for recipe in recipes.RECIPES]


@pytest.mark.parametrize("argv", [["no_such_recipe"], ["gpu_tests_1gpu", "no_such_recipe"], []])
def test_an_unknown_recipe_is_one_line_and_exit_2(argv):
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu.run", *argv],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("benchmarks.gpu.run: ")


STUBS = (
    Recipe("stub_ok", 0, "a stub", "result.txt",
           (Step("write", "echo hi > {out}/result.txt; echo multicast=$NCCL_NVLS_ENABLE $EXTRA",
                 env={"EXTRA": "{out}/extra"}),)),
    Recipe("stub_fails", 0, "a stub", "-", (Step("bad", "exit 3"), Step("after", "true"))),
    Recipe("stub_slow", 0, "a stub", "-", (Step("sleep", "sleep 30", timeout_s=1),)),
    Recipe("stub_many_gpus", 64, "a stub", "-", (Step("never", "true"),)),
    Recipe("stub_needs_wheel", 0, "a stub", "-", (Step("never", "true"),),
           needs=(".whl/no_such_package-*.whl",)),
)


def _record(out: Path, name: str) -> tuple:
    with tarfile.open(out / f"{name}.tgz") as tar:
        members = sorted(tar.getnames())
        record = json.load(tar.extractfile(f"{name}/record.json"))
        logs = {member: tar.extractfile(member).read().decode()
                for member in members if member.endswith((".log", ".txt"))}
    return members, record, logs


def test_stubbed_recipes_record_their_status_and_pack_under_out(tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    names = [recipe.name for recipe in STUBS]
    rc = run.main([*names, "--out", str(out), "--work", str(work), "--no-install"], STUBS)
    assert rc == 1  # stub_fails and stub_slow
    ran = ["stub_ok", "stub_fails", "stub_slow"]  # the skipped ones pack nothing
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{name}.tgz" for name in ran] + ["summary.md"])
    members, record, logs = _record(out, "stub_ok")
    assert [m for m in members if m != "stub_ok/tree.diff"] == [
        "stub_ok", "stub_ok/record.json", "stub_ok/result.txt", "stub_ok/write.log"]
    folder = str(work / "stub_ok")
    assert f"multicast=0 {folder}/extra" in logs["stub_ok/write.log"]
    assert record["status"] == "ok" and record["recipe"] == "stub_ok"
    [step] = record["steps"]
    assert step["rc"] == 0 and step["command"].startswith(f"echo hi > {folder}/result.txt")
    assert step["env"] == {"EXTRA": f"{folder}/extra"}
    assert step["nccl_env"]["NCCL_NVLS_ENABLE"] == "0"
    assert step["nccl_env"]["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert step["nccl_env"]["NVSHMEM_DISABLE_NVLS"] == "1"
    machine = record["machine"]
    for key in ("date", "torch", "nccl", "triton", "python", "gpus", "nvidia_smi"):
        assert key in machine
    statuses = {name: _record(out, name)[1]["status"] for name in ran}
    assert statuses["stub_fails"] == "failed: bad rc=3"
    assert [s["rc"] for s in _record(out, "stub_fails")[1]["steps"]] == [3, 0]
    assert statuses["stub_slow"] == "timeout: sleep"
    assert _record(out, "stub_slow")[1]["seconds"] < 15
    summary = (out / "summary.md").read_text()
    assert "| stub_ok | ok | " in summary and "| stub_fails | failed: bad rc=3 | " in summary
    assert re.search(r"\| stub_many_gpus \| skipped: needs 64 GPU\(s\), \d+ visible \| 0.0 \| - \|",
                     summary)
    assert ("| stub_needs_wheel | skipped: needs .whl/no_such_package-*.whl (not carried) | "
            "0.0 | - |") in summary
    assert capsys.readouterr().out.rstrip().endswith(summary.rstrip().splitlines()[-1])


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c",
                           "commit.gpgsign=false", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def _dry_run(monkeypatch, repo: Path, out: Path) -> tuple:
    """`stub_ok --dry-run` with the runner's tree at `repo` -> (members, record, summary)."""
    monkeypatch.setattr(run, "REPO", repo)
    monkeypatch.setattr(run, "machine", lambda env: {"gpus": 0, "nvidia_smi": [], "date": "d"})
    rc = run.main(["stub_ok", "--dry-run", "--out", str(out), "--work", str(out / "work")],
                  STUBS)
    assert rc == 0
    members, record, _ = _record(out, "stub_ok")
    return members, record, (out / "summary.md").read_text()


def test_a_dry_run_records_the_commit_the_dirty_flag_and_the_diff_hash(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.txt").write_text("one\n")
    (repo / ".gitignore").write_text("ignored.txt\n")
    _git(repo, "add", "a.txt", ".gitignore")
    _git(repo, "commit", "-q", "-m", "first")
    head = _git(repo, "rev-parse", "HEAD")
    members, record, summary = _dry_run(monkeypatch, repo, tmp_path / "clean")
    assert record["code"]["commit"] == head and record["code"]["dirty"] is False
    assert record["code"]["diff"] is None and "stub_ok/tree.diff" not in members
    assert record["status"] == "dry run" and [s["rc"] for s in record["steps"]] == [None]
    assert "stub_ok/result.txt" not in members  # the step did not run
    assert f"commit {head[:12]} (clean)" in summary
    hashes = []
    for n, change in enumerate([lambda: (repo / "a.txt").write_text("two\n"),
                                lambda: (repo / "b.txt").write_text("new\n"),  # untracked
                                lambda: (repo / "a.txt").write_text("three\n")]):
        change()
        (repo / "ignored.txt").write_text(f"ignored {n}\n")  # never part of the diff
        out = tmp_path / f"dirty{n}"
        members, record, summary = _dry_run(monkeypatch, repo, out)
        code = record["code"]
        with tarfile.open(out / "stub_ok.tgz") as tar:
            diff = tar.extractfile("stub_ok/tree.diff").read()
        assert code["commit"] == head and code["dirty"] is True and code["diff"] == "tree.diff"
        assert code["diff_sha256"] == hashlib.sha256(diff).hexdigest()
        assert f"commit {head[:12]} (dirty, diff sha256 {code['diff_sha256'][:12]})" in summary
        hashes.append(code["diff_sha256"])
    assert len(set(hashes)) == 3 and code["untracked_files"] == 1
    copy = tmp_path / "copy"  # the diff, applied to the commit, gives the tree back
    _git(tmp_path, "clone", "-q", str(repo), str(copy))
    (tmp_path / "tree.diff").write_bytes(diff)
    _git(copy, "apply", str(tmp_path / "tree.diff"))
    assert [(copy / name).read_text() for name in ("a.txt", "b.txt")] == ["three\n", "new\n"]


@pytest.mark.parametrize("where, why", [("plain", "git rev-parse: fatal: not a git repository"),
                                        ("worktree_file", "git rev-parse: fatal: not a git "),
                                        ("nested", "is not a git tree's root")])
def test_a_tree_without_a_usable_git_is_recorded_as_unknown_with_the_reason(
        tmp_path, monkeypatch, where, why):
    monkeypatch.delenv("GIT_DIR", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repo above tmp_path
    repo = tmp_path / "copy"
    repo.mkdir()
    if where == "worktree_file":  # a worktree copied without the repository it points to
        (repo / ".git").write_text("gitdir: /nowhere/.git/worktrees/copy\n")
    if where == "nested":  # a folder inside some other repository
        _git(tmp_path, "init", "-q")
        monkeypatch.delenv("GIT_CEILING_DIRECTORIES")
    _, record, summary = _dry_run(monkeypatch, repo, tmp_path / "out")
    code = record["code"]
    assert (code["commit"], code["dirty"], code["diff_sha256"]) == ("unknown",) * 3
    assert why in code["reason"], code["reason"]
    assert f"commit unknown ({code['reason']})" in summary


def test_no_step_starts_past_the_time_limit(tmp_path):
    out = tmp_path / "out"
    rc = run.main(["stub_ok", "--out", str(out), "--work", str(tmp_path / "work"),
                   "--no-install", "--time-limit", "5"], STUBS)
    assert rc == 1
    _, record, _ = _record(out, "stub_ok")
    assert record["status"] == "cut: time limit before write"
    assert record["steps"][0]["rc"] is None


def test_a_timed_out_step_leaves_no_process_behind(tmp_path):
    """torchrun starts its workers in sessions of their own: a step past its limit must stop
    them too, or they keep the GPUs' memory for every later step."""
    pid_file = tmp_path / "child.pid"
    spawn = (f"{sys.executable} -c \"import subprocess, time; child = subprocess.Popen("
             f"['sleep', '300'], start_new_session=True); open('{pid_file}', 'w').write("
             f"str(child.pid)); time.sleep(300)\"")
    rc = run.run_step(spawn + " & wait", dict(os.environ), tmp_path / "step.log", timeout=3)
    assert rc == 124
    child = int(pid_file.read_text())
    assert not run._alive([child])


def _training_argvs(command: str) -> list:
    """The epoverlap.train argument lists of one formatted step command: each `TR -m
    epoverlap.train ...` up to `&&`, and a bench_train_rounds command's base run with each
    --side's flags added. A shell substitution `$(...)` stands for a number."""
    words = shlex.split(re.sub(r"\$\([^)]*\)", "1", command))
    argvs, i = [], 0
    while i < len(words):
        if words[i:i + 3] == ["TR", "-m", "epoverlap.train"]:
            end = next((j for j in range(i + 3, len(words)) if words[j] in ("&&", ";", "||")),
                       len(words))
            argvs.append(words[i + 3:end])
            i = end
        i += 1
    if "benchmarks.harness.bench_train_rounds" in words and argvs:
        sides = [words[j + 1].partition("=")[2] for j, word in enumerate(words)
                 if word == "--side"]
        argvs = [argvs[0] + shlex.split(side) for side in sides] or argvs
    return argvs


def test_every_training_command_of_a_recipe_parses_and_validates(monkeypatch):
    """A typo in a recipe's training flags would cost a device call: every such command is
    parsed and checked by the training command's own config rules, at the recipe's GPUs (and
    the GPU machines' torch, whose NCCL takes a communicator config)."""
    monkeypatch.setattr(validate, "nccl_config_unavailable", lambda: None)
    checked = 0
    for recipe in recipes.RECIPES:
        for step in recipe.steps:
            for argv in _training_argvs(step.command.format(**NAMES)):
                try:
                    cfg = parse_config(argv, printing=False)
                    validate_config(cfg, world_size=recipe.gpus, cuda_available=True)
                except (SystemExit, ConfigError) as error:
                    pytest.fail(f"{recipe.name}/{step.name}: {' '.join(argv)}: {error}")
                checked += 1
    assert checked > 50


def test_a_runner_takes_its_gpus_from_the_callers_visible_devices():
    """Two runners on two GPUs of one machine (CUDA_VISIBLE_DEVICES=0 and =1) each keep theirs;
    without the variable a recipe gets the first GPUs."""
    from benchmarks.gpu.run import visible_devices
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "1"}, 1) == "1"
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "2,3,1"}, 2) == "2,3"
    assert visible_devices({}, 2) == "0,1"
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}, 1) == "0"
