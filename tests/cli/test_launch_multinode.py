"""Multi-node launch: `epoverlap-launch --nnodes N --rdzv-endpoint HOST:PORT ...` and the Slurm
recipe (examples/slurm/train.sbatch).

Default tier: the launcher's node flags, one line and exit status 2 when wrong, the world they
check the training flags against, the torchrun line they make, and the recipe's own training
flags against its 2 x 8 world. Slow tier: the recipe itself run as two local "nodes" (two
subprocesses on 127.0.0.1, SLURM_* set per node, `srun`/`scontrol` stubbed), gloo, one rank
each, to the last step. Multi-host GPU runs are not tested here (docs/multinode.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dist_helpers import free_port
from epoverlap.cli.launch import Nodes, main, plan_launch, plan_nodes, split_launcher_flags
from test_launch import QUICK, _env

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
ENDPOINT = ["--rdzv-endpoint", "127.0.0.1:29500"]


def _cpu_only(monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)


@pytest.mark.parametrize("flags, line", [
    (["--nnodes", "0"], "--nnodes=0: must be >= 1"),
    (["--nnodes", "two", *ENDPOINT], "--nnodes=two: an integer"),
    (["--nnodes", "2"], "--nnodes=2: needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "node001"], "--rdzv-endpoint=node001: HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "node001:http"], "--rdzv-endpoint=node001:http: "),
    (["--nnodes", "2", "--rdzv-endpoint", ":29500"], "--rdzv-endpoint=:29500: HOST:PORT"),
    (["--nnodes", "2", *ENDPOINT, "--node-rank", "2"], "--node-rank=2: must be in [0, --nnodes=2)"),
    (["--nnodes=2", *ENDPOINT, "--node-rank=-1"], "--node-rank=-1: must be in [0, --nnodes=2)"),
    (["--node-rank", "1"], "--node-rank=1: must be in [0, --nnodes=1)"),
    (["--nnodes", "2", *ENDPOINT, "--rdzv-id="], "--rdzv-id=(empty): "),
])
def test_bad_node_flags_are_one_line_and_exit_2(flags, line, capsys, monkeypatch):
    _cpu_only(monkeypatch)
    assert main(flags) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [err.strip()] and err.startswith("epoverlap-launch: error: ")
    assert line in err, err


def test_the_flags_are_checked_against_every_node_s_ranks(capsys, monkeypatch):
    """2 nodes x 2 CPU ranks: EP 4 fits the world of 4 (one node's 2 ranks would refuse it),
    EP 8 does not; the data files are read for the job's DP size too."""
    _cpu_only(monkeypatch)
    ranks, on_gpu, train_args = plan_launch(["--nnodes", "2", *ENDPOINT,
                                             "--expert-model-parallel-size", "4"])
    assert (ranks, on_gpu) == (2, False)
    assert train_args == ["--preset", "tiny", "--expert-model-parallel-size", "4"]
    assert main(["--nnodes", "2", *ENDPOINT, "--nproc", "2",
                 "--expert-model-parallel-size", "8"]) == 2
    assert "--expert-model-parallel-size=8: must divide the world size 4" in \
        capsys.readouterr().err


def test_one_node_stays_standalone_and_several_use_the_c10d_rendezvous():
    assert plan_nodes({}) == Nodes(1, None, "epoverlap")
    assert Nodes().torchrun_args(2) == ["--standalone", "--nproc-per-node=2"]
    # a one-node Slurm job passes the same flags: checked, then --standalone
    one = plan_nodes({"--nnodes": "1", "--node-rank": "0", "--rdzv-endpoint": "node001:29500"})
    assert one.torchrun_args(8) == ["--standalone", "--nproc-per-node=8"]
    values, rest = split_launcher_flags(["--nnodes", "4", "--bf16", "--node-rank=3",
                                         "--rdzv-endpoint", "[fe80::1]:29500",
                                         "--rdzv-id", "job7", "--nproc=8", "--train-iters", "3"])
    assert rest == ["--bf16", "--train-iters", "3"]
    assert plan_nodes(values).torchrun_args(int(values["--nproc"])) == [
        "--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d",
        "--rdzv-endpoint=[fe80::1]:29500", "--rdzv-id=job7"]


def _sbatch_array(name: str) -> list[str]:
    """The recipe's bash array `name`, as bash expands it (SLURM_JOB_ID=7)."""
    text = SBATCH.read_text()
    block = re.search(rf"^{name}=\(\n.*?^\)\n", text, re.S | re.M)
    assert block, f"no {name}=( ... ) block in {SBATCH}"
    script = f'SLURM_JOB_ID=7\n{block.group(0)}printf "%s\\n" "${{{name}[@]}}"\n'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          check=True).stdout.splitlines()


def test_the_slurm_recipe_asks_one_task_per_node_and_its_flags_fit_its_world():
    from epoverlap.config import parse_config, resolve_config, validate_config
    text = SBATCH.read_text()
    directives = dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)", text, re.M))
    assert directives["ntasks-per-node"] == "1" and "gpus-per-node" in directives
    world = int(directives["nodes"]) * int(directives["gpus-per-node"])
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in text
    for flag in ('--nnodes "$SLURM_NNODES"', '--node-rank "$SLURM_NODEID"',
                 '--rdzv-endpoint "$MASTER:$RDZV_PORT"', '--rdzv-id "$SLURM_JOB_ID"'):
        assert flag in text
    flags = _sbatch_array("TRAIN_FLAGS")
    assert flags[:2] == ["--preset", "small"] and "logs/7" in flags
    cfg = resolve_config(parse_config(flags, printing=False), world, False)
    validate_config(cfg, world, False)
    assert cfg.parallel.expert_model_parallel_size == int(directives["gpus-per-node"])


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _node_env(stubs: Path, node: int, port: int) -> dict:
    env = _env()
    env.update(SLURM_NNODES="2", SLURM_NODEID=str(node), SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1", SLURM_CPUS_PER_TASK="1",
               RDZV_PORT=str(port),
               PATH=os.pathsep.join([str(stubs), str(Path(sys.executable).parent),
                                     env.get("PATH", "")]))
    return env


@pytest.mark.slow
def test_the_slurm_recipe_runs_as_two_local_nodes(tmp_path):
    """The recipe as written but for its TRAIN_FLAGS (a tiny run on mock data): `srun` runs
    its command once per "node" here, `scontrol` lists the nodes; `--nproc 1` after the
    script's name, as `sbatch train.sbatch --nproc 1` would pass it."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    _stub(stubs, "srun", 'while [[ $1 == -* ]]; do shift; done\nexec "$@"\n')
    _stub(stubs, "scontrol", '[[ "$1 $2" == "show hostnames" ]] && tr , "\\n" <<< "$3"\n')
    quick = " ".join([*QUICK, "--train-iters", "4", "--mock-data"])
    script, count = re.subn(r"^TRAIN_FLAGS=\(\n.*?^\)\n", f"TRAIN_FLAGS=({quick})\n",
                            SBATCH.read_text(), flags=re.S | re.M)
    assert count == 1
    (tmp_path / "train.sbatch").write_text(script)
    port = free_port()
    nodes = [subprocess.Popen(["bash", "train.sbatch", "--nproc", "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                              env=_node_env(stubs, node, port)) for node in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, out[-2000:] + err[-3000:]
        assert (f"epoverlap-launch: 2 nodes x 1 CPU rank(s) = world 2, gloo: torchrun "
                f"--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d "
                f"--rdzv-endpoint=127.0.0.1:{port} --rdzv-id=4242 -m epoverlap.train") in out
    rank0 = [out for out, _ in outputs if "step    4/4" in out]
    assert len(rank0) == 1, outputs
    assert "epoverlap: world 2 (gloo, cpu) = DP 2 (EP 2 x EDP 1)" in rank0[0]
