"""What the GPU recipes are made of: `Step` and `Recipe`, the training command's common flags,
and the interleaved-rounds step (benchmarks/gpu/recipes.py has the placeholders a command may
hold: {python}, {torchrun}, {gpus}, {out}, {scratch}: a folder of the runner's
for large files not sent back)."""

from __future__ import annotations

from dataclasses import dataclass, field

from epoverlap.config.resolve import SEQUENTIAL_FLAG


@dataclass(frozen=True)
class Step:
    name: str
    command: str
    env: dict = field(default_factory=dict)  # added to the environment (values formatted too)
    timeout_s: int = 540


@dataclass(frozen=True)
class Recipe:
    name: str  # what it measures, not when it was written
    gpus: int  # GPUs it needs
    measures: str
    records: str  # the files under {out}, besides every step's log and record.json
    steps: tuple
    all_gpus: bool = False  # run on every visible GPU (at least `gpus`)
    needs: tuple = ()  # globs the carried tree must match (wheels, an earlier tree)


SEQUENTIAL = SEQUENTIAL_FLAG  # pins the sequential schedule
# every pytest step names its own -m: it replaces the project's default `-m 'not slow'`
PYTEST = "{python} -m pytest -q -p no:cacheprovider --durations=15"
# a whole tier: each test named as it ends, so a step cut at its limit still says which failed
TIER = "{python} -m pytest -v -rfE --tb=short -p no:cacheprovider --durations=15"
TRAIN = "{torchrun} -m epoverlap.train"
# the same with the benchmark-only flags (--comm-mode local_copy, --local-copy-hold-us N)
TRAIN_BENCH = "{torchrun} -m benchmarks.harness.train_bench"
# the bitwise contract's command: the path users run, bf16, optimizer on, deterministic
BITWISE_RUN = (TRAIN + " --preset small --bf16 --deterministic-mode --seed 3 --train-iters 30"
               " --log-interval 10 --expert-model-parallel-size {gpus}")
OVERLAP = "--overlap-moe-expert-parallel-comm"
WGRAD = OVERLAP + " --delay-wgrad-compute"
GRAPHS = "--cuda-graph-impl local --cuda-graph-modules attn moe_router moe_preprocess"
EAGER = "--cuda-graph-impl none"  # on GPUs the default is GRAPHS (epoverlap.config.resolve)
BUDGET = "--moe-dispatch-budget 1.25"
FULL_ITERATION = BUDGET + " --cuda-graph-impl full_iteration"


def rounds_step(sides: dict, command: str, out: str, env: dict = None, rounds: int = 3,
               timeout_s: int = 420) -> Step:
    """`bench_train_rounds` over `sides` (name -> flags added to `command`), into {out}/`out`."""
    flags = " ".join(f"--side '{name}={value}'" for name, value in sides.items())
    return Step(f"rounds_{out}", "{python} -m benchmarks.harness.bench_train_rounds --warmup 4 "
                f"--rounds {rounds} --out {{out}}/{out} {flags} -- {command}",
                env=dict(env or {}), timeout_s=timeout_s)
