"""torchtitan at commit d84e83dc4 on one GPU: one run of its own training command at one of the
peer shapes, eager or compiled, every step's line kept.

    python -m benchmarks.harness.peer_titan_1gpu --shape qwen3|mixtral|dsv3 \
        --mode eager|compiled [--steps 30] [--timeout 420] [--out FILE.json] \
        [-- TORCHTITAN FLAGS ...]

Installs nothing on the machine beyond the carry: `.titan/src` (torchtitan's package and its
test tokenizer, `git archive` of the commit) goes first on PYTHONPATH, and the wheels of
`.titan/whl` (tyro, docstring_parser, typeguard, torchdata, typing_extensions: what its train
path imports that the GPU image lacks) are unpacked once into /tmp/titan-site with
`pip install --no-index --no-deps --target` (a folder of their own: `.whl/` may hold another
torchtitan). torchtitan's trainer imports its Hugging Face text loader, and through it
`datasets`, which the image lacks and this benchmark does not use (its tokens are
`titan_shapes.RandomTokens`): a stand-in `datasets` that raises if called goes on the path
after the carry (`DATASETS_STANDIN`).

The command is torchtitan's run_train.sh at that commit for one GPU: torchrun with
`PYTORCH_ALLOC_CONF=expandable_segments:True` and `-m torchtitan.train --module
benchmarks.harness.titan_shapes --config CONFIG`, then `--training.steps N
--debug.moe_force_load_balance --dump_folder DIR` and, compiled, `--compile.enable` (torch.compile
of each block's parts and of the loss, torchtitan's `apply_compile_sparse`). Its step line
(`step: 5  loss: ...  memory: 42.10GiB(30.12%)  tps: 39,218  tflops: ...  mfu: ...%`, one a step:
the config logs every step) gives each step's tokens/s over the whole step (the time between
two step lines), the step time (tokens per step / tokens/s) and the allocator's peak reserved
memory over the step. Writes FILE.json: every step's sample, the build (torchtitan commit,
mode, torch and Python versions), the exact command and its environment additions, the exit
status (124: stopped at --timeout seconds); the log beside it. Exit status: 0, or 1 when the run
failed or logged no step.

`SHAPES` pairs each shape with its epoverlap preset and its torchtitan config function
(benchmarks/harness/titan_shapes.py); `PEER_FLAGS` are the flags both systems' configs are read
with (benchmarks/harness/peer_titan_rounds.py runs epoverlap with them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
CARRY = Path(os.environ.get("EPOVERLAP_TITAN_CARRY", REPO / ".titan"))
SITE = Path("/tmp/titan-site")  # where the carried wheels are unpacked
TITAN_MODULE = "benchmarks.harness.titan_shapes"
TOKENS_PER_STEP = 8192  # micro-batch 1 x 2 microbatches x seq 4096 (torchtitan: local batch 2)
MODES = ("eager", "compiled")


class Shape(NamedTuple):
    preset: str  # epoverlap's --preset
    config: str  # titan_shapes' config function


SHAPES = {"qwen3": Shape("qwen3-30b-a3b-proxy", "qwen3_proxy"),
          "mixtral": Shape("mixtral-1gpu-proxy", "mixtral_proxy"),
          "dsv3": Shape("dsv3-1gpu-proxy", "dsv3_proxy")}
PEER_FLAGS = ("--micro-batch-size", "1", "--num-microbatches", "2",
              "--moe-router-force-load-balancing")

# torchtitan's trainer imports torchtitan.hf_datasets.text_datasets, which imports these
DATASETS_STANDIN = {
    "__init__.py": '"""Stand-in for `datasets` (benchmarks/harness/peer_titan_1gpu.py): '
                   'imported, never used."""\n\n\nclass Dataset:\n    pass\n\n\n'
                   'def load_dataset(*args, **kwargs):\n    raise RuntimeError("no `datasets` '
                   'here: the peer benchmark feeds random tokens")\n',
    "distributed.py": 'def split_dataset_by_node(*args, **kwargs):\n    raise RuntimeError('
                      '"no `datasets` here: the peer benchmark feeds random tokens")\n'}

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(
    r"(?<!validate )step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<grad_norm>\S+)"
    r"\s+memory:\s*(?P<mem>[\d.]+)GiB\((?P<mem_pct>[\d.]+)%\)\s+tps:\s*(?P<tps>[\d,]+)"
    r"\s+tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+%|N/A)")


def epoverlap_config(preset: str):
    """epoverlap's config of `preset` with the peer flags (its model vocabulary not yet set:
    `cfg.data.vocab_size` is NullTokenizer's N ids)."""
    from epoverlap.config import parse_config
    return parse_config(["--preset", preset, *PEER_FLAGS])


def carry_problem(carry: Path = CARRY):
    """Why the torchtitan carry cannot run here (a sentence), or None."""
    if not (carry / "src" / "torchtitan" / "train.py").is_file():
        return f"no torchtitan source at {carry / 'src'} (benchmarks/peer.md: the carry)"
    if not list((carry / "whl").glob("*.whl")):
        return f"no wheels in {carry / 'whl'} (benchmarks/peer.md: the carry)"
    return None


def titan_commit(carry: Path = CARRY) -> str:
    found = carry / "src" / "COMMIT"
    return found.read_text().strip() if found.is_file() else "unknown"


def install_wheels(carry: Path = CARRY, site: Path = SITE) -> None:
    """The carried wheels unpacked into `site`, once per set of wheels."""
    wheels = sorted(str(p) for p in (carry / "whl").glob("*.whl"))
    stamp = site / ".wheels"
    if stamp.is_file() and stamp.read_text() == "\n".join(wheels):
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                    *wheels], check=True)
    stamp.write_text("\n".join(wheels))


def write_standin(folder: Path) -> Path:
    """DATASETS_STANDIN under `folder`/datasets; returns `folder` (for the path)."""
    package = folder / "datasets"
    package.mkdir(parents=True, exist_ok=True)
    for name, text in DATASETS_STANDIN.items():
        (package / name).write_text(text)
    return folder


def titan_env(standin: Path, carry: Path = CARRY, site: Path = SITE) -> dict:
    """The environment additions of a torchtitan run: the carry, the stand-in, the wheels and
    this tree on PYTHONPATH (in that order), and run_train.sh's allocator setting."""
    path = [str(carry / "src"), str(standin), str(site), str(REPO)]
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join(path + ([old] if old else [])),
            "PYTORCH_ALLOC_CONF": "expandable_segments:True", "LOG_RANK": "0"}


def titan_command(shape: str, mode: str, steps: int, dump_folder: str, extra=()) -> list:
    """torchtitan's training command for one GPU (run_train.sh's torchrun line)."""
    compiled = ["--compile.enable"] if mode == "compiled" else []
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
            "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0", "--local-ranks-filter", "0",
            "--role", "rank", "--tee", "3", "-m", "torchtitan.train", "--module", TITAN_MODULE,
            "--config", SHAPES[shape].config, "--training.steps", str(steps),
            "--debug.moe_force_load_balance", "--dump_folder", dump_folder, *compiled, *extra]


def parse_titan_log(text: str, tokens_per_step: int = TOKENS_PER_STEP) -> list:
    """Every training step line of torchtitan's log (colors stripped; validation lines left
    out), in order: step, loss, grad_norm, tokens_per_s, step_ms, peak_reserved_gib (and its
    share of the device), its own tflops and mfu (None where it prints N/A)."""
    samples = []
    for line in _ANSI.sub("", text).splitlines():
        found = _STEP.search(line)
        if found is None:
            continue
        tps = float(found["tps"].replace(",", ""))
        samples.append({"step": int(found["step"]), "loss": float(found["loss"]),
                        "grad_norm": float(found["grad_norm"]), "tokens_per_s": tps,
                        "step_ms": 1e3 * tokens_per_step / tps if tps else None,
                        "peak_reserved_gib": float(found["mem"]),
                        "peak_reserved_pct": float(found["mem_pct"]),
                        "titan_tflops": float(found["tflops"].replace(",", "")),
                        "titan_mfu_pct": None if found["mfu"] == "N/A"
                        else float(found["mfu"].rstrip("%"))})
    return samples


def run_logged(command: list, env: dict, log: Path, timeout_s: float) -> int:
    """`command` from the repo root with `env` added, its output to `log`; past `timeout_s`
    it is sent SIGTERM (torchrun then stops its workers), SIGKILL 20 s later: 124."""
    with open(log, "w") as output:
        proc = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                env={**os.environ, **env}, cwd=REPO)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return 124


def torch_version(env: dict) -> str:
    found = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True, env={**os.environ, **env})
    return found.stdout.strip() or "unknown"


def run_titan(shape: str, mode: str, steps: int, out: Path, extra=(),
              timeout_s: float = 420) -> dict:
    """One torchtitan run (see the module docstring): its record, also written to `out` and its
    log to `out` with .log."""
    problem = carry_problem()
    if problem:
        raise SystemExit(f"peer_titan_1gpu: {problem}")
    install_wheels()
    log = out.with_suffix(".log")
    with tempfile.TemporaryDirectory(prefix="titan-") as tmp:
        env = titan_env(write_standin(Path(tmp) / "standin"))
        command = titan_command(shape, mode, steps, str(Path(tmp) / "dump"), extra)
        start = time.time()
        rc = run_logged(command, env, log, timeout_s)
        seconds = round(time.time() - start, 1)
    record = {"system": "torchtitan", "shape": shape, "preset": SHAPES[shape].preset,
              "mode": mode, "rc": rc, "seconds": seconds,
              "build": {"torchtitan_commit": titan_commit(), "mode": mode,
                        "torch": torch_version(env), "python": platform.python_version()},
              "command": shlex.join(command), "env": env, "log": log.name,
              "tokens_per_step": TOKENS_PER_STEP,
              "steps": parse_titan_log(log.read_text(errors="replace"))}
    out.write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("peer_titan.json"))
    parser.add_argument("--timeout", type=float, default=420, help="seconds the run may take")
    parser.add_argument("extra", nargs="*", help="torchtitan flags, after --")
    args = parser.parse_args(argv)
    record = run_titan(args.shape, args.mode, args.steps, args.out, args.extra, args.timeout)
    steps = record["steps"]
    print(f"{args.shape} {args.mode}: rc {record['rc']}, {len(steps)} steps, "
          f"{record['seconds']} s" + (f", last {steps[-1]['tokens_per_s']:,.0f} tokens/s"
                                      if steps else ""))
    return 0 if record["rc"] == 0 and steps else 1


if __name__ == "__main__":
    sys.exit(main())
