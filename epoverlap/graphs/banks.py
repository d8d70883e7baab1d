"""Graph banks: one set of captured graphs per runtime size, the one in use picked at run time.

Owns `GraphBanks`. A bank is a `GraphRunner` (per-layer graphs) or a `FullIterationGraph`,
made by its path's factory (`StepGraphs.make_bank`); the key is the budget level of the
sync-free dropless dispatch (`epoverlap.model.budget.DispatchBudget`), because the all-to-all buffers inside graphs that hold
the dispatch are sized by it: the base budget's bank serves every step, and a step whose
dispatch overflowed is rerun by the bank of the level that holds it. A bank is captured the
first time it is needed after the warmup steps (its first run is eager and records what it
reads and writes), so a run that never overflows holds one bank. At most `max_banks` banks
exist (the number of budget levels: log2(EP size / budget) + 1), each in its own memory pool,
and `memory_report` says what each holds.

With the path tuner (`--tune`, `training.tuning.tuner`) a bank is also per path: each path has a
`StepGraphs` of its own over the run's `GraphBanks`, its keys (path, level). A bank is captured
for one plan: its graphs in that plan's order in its own pool, its buffers per microbatch slot as that plan's liveness gives them (`graphs.capture`: the
sequential plan has one slot, the combined 1F1B two), and with or without
the weight-grad graphs of delayed weight grads, so a bank replayed under another path could
hand two live microbatches one slot. The losing paths' banks are released after the decision,
and a path's banks when its capture failed (`StepGraphs.release_path`).

Under dynamic context parallelism (`model.context.DynamicContext`) the one bank is a
`SizeBanks`: a `GraphRunner` per CP size of the run's set, each with its own slot buffers and
pool, a microbatch's nodes run by the runner of its size (read from its tokens' length), so a
size's graphs and slots only ever serve microbatches of that size. Every runner records and
captures: size 1's attention graphs hold no exchange (a size-1 segment's attention is local),
a larger size's hold the ring or the K/V gather over that size's group (its NCCL collectives
captured; every rank of the group cuts the same segments, so they record and capture at the
same steps). The bound is explicit and made at start: one runner per size of the set
(log2(CP / --min-dynamic-context-parallel-size) + 1), each runner's graphs one per (range,
microbatch, phase) as any runner's, its slots as the plan's liveness gives them; a runner
records in each step after the warmup until a step with a microbatch at its size gave it
every signature, and is captured after that step (sizes that never come stay eager).

Why budgets and not token counts: our batches have a fixed sequence length and micro-batch
size, so the token count per microbatch never varies and banks per token-count bucket (seed
001's dynamic sizes) would hold one bank; the budget is the size that does vary at run time.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional


class GraphBanks:
    """Banks by key; `select(key)` makes the bank in use (creating it, within the bound, by
    `make_bank`, else the one given here)."""

    def __init__(self, make_bank: Optional[Callable[[], object]], max_banks: int):
        self.make_bank, self.max_banks = make_bank, max_banks
        self.banks: dict = {}
        self.key: Hashable = None

    def select(self, key: Hashable, make_bank: Optional[Callable[[], object]] = None):
        if key not in self.banks:
            if len(self.banks) >= self.max_banks:
                raise RuntimeError(f"graph bank {key!r}: already {len(self.banks)} banks "
                                   f"({sorted(self.banks)}), the bound is {self.max_banks}")
            self.banks[key] = (make_bank or self.make_bank)()
        self.key = key
        return self.banks[key]

    @property
    def active(self):
        return self.banks[self.key]

    def __call__(self, spec, microbatch: int):
        """The run factory of the bank in use (per-layer graphs)."""
        return self.active(spec, microbatch)

    def memory_report(self) -> str:
        """'budget level 0: 12 graphs, 0.010 GiB; ...' for every captured bank."""
        parts = [f"bank {key}: {bank.graph_count()} graphs, {bank.pool_bytes / 2**30:.3f} GiB"
                 for key, bank in sorted(self.banks.items()) if bank.captured]
        return "; ".join(parts) or "no bank captured"

    def release(self, keys=None) -> None:
        """Release the banks of `keys` (default: every bank) and their memory pools."""
        for key in list(self.banks) if keys is None else list(keys):
            self.banks.pop(key).release()


class SizeBanks:
    """Dynamic CP's bank: a runner per CP size (`make_runner(size)`); `route(inputs)` before
    each run says which runner each microbatch's nodes go to (the length of its tokens: its
    size x S / CP), so a slot buffer only ever holds one size's tensors. Used where
    `GraphBanks` holds a `GraphRunner`: `recording`, `captured` and `capture` speak for every
    runner; `captured_now`: the sizes the last `capture` captured."""

    def __init__(self, make_runner: Callable[[int], object], sizes: tuple[int, ...],
                 local_tokens: int):
        self.runners = {size: make_runner(size) for size in sizes}
        self.local_tokens = local_tokens
        self.size_of: dict[int, int] = {}  # microbatch -> its CP size in this run
        self.captured_now: tuple[int, ...] = ()

    def route(self, inputs: list[dict]) -> None:
        self.size_of = {microbatch: values["tokens"].shape[1] // self.local_tokens
                        for microbatch, values in enumerate(inputs)}

    def __call__(self, spec, microbatch: int):
        return self.runners[self.size_of[microbatch]](spec, microbatch)

    @property
    def recording(self) -> bool:
        return any(runner.recording for runner in self.runners.values())

    @recording.setter
    def recording(self, value: bool) -> None:
        for runner in self.runners.values():
            runner.recording = value and not runner.captured

    @property
    def captured(self) -> bool:
        return all(runner.captured for runner in self.runners.values())

    def capture(self, plan) -> None:
        """Capture every runner a step recorded in full (the others wait), smallest size
        first (the same order on every rank of a group: their captures warm up collectives)."""
        self.captured_now = ()
        for size, runner in sorted(self.runners.items()):
            if not runner.captured and runner.recorded:
                runner.capture(plan)
                self.captured_now += (size,)

    def graph_count(self) -> int:
        return sum(runner.graph_count() for runner in self.runners.values())

    def buffer_bytes(self) -> int:
        return sum(runner.buffer_bytes() for runner in self.runners.values())

    @property
    def pool_bytes(self) -> int:
        return sum(runner.pool_bytes for runner in self.runners.values())

    @property
    def capture_seconds(self) -> float:
        return sum(runner.capture_seconds or 0.0 for runner in self.runners.values())

    def release(self) -> None:
        for runner in self.runners.values():
            runner.release()


class StepGraphs:
    """One path's side of the run's CUDA graphs: which bank an attempt of a step uses, when a
    bank records (its first eager attempt at or after the last warmup step) and when it is
    captured (after that step). `per_level`: one bank per budget level (graphs that hold the
    dispatch); else one bank for every level. `full_iteration`: the bank runs the whole plan
    itself. `path`: the tuner's name of the path whose banks these are (None: the run's only
    path); `make_bank`: what makes one of its banks."""

    def __init__(self, banks: GraphBanks, warmup_steps: int, per_level: bool,
                 full_iteration: bool, path: Optional[str] = None,
                 make_bank: Optional[Callable[[], object]] = None):
        self.banks, self.warmup_steps = banks, warmup_steps
        self.per_level, self.full_iteration = per_level, full_iteration
        self.path, self.make_bank = path, make_bank
        self._due: dict = {}  # bank key -> a budget level to capture it at

    def key(self, level: int) -> Hashable:
        """The bank of `level` (0 unless per level), of this path where the tuner has several."""
        level_key = level if self.per_level else 0
        return level_key if self.path is None else (self.path, level_key)

    def select(self, level: int):
        """Make `level`'s bank of this path the one in use (created if new)."""
        return self.banks.select(self.key(level), self.make_bank)

    def release_path(self) -> int:
        """Release every bank of this path (one the tuner dropped, or did not choose); -> the
        pool bytes freed."""
        keys = [key for key in self.banks.banks
                if isinstance(key, tuple) and key[0] == self.path]
        freed = sum(self.banks.banks[key].pool_bytes for key in keys
                    if self.banks.banks[key].captured)
        self.banks.release(keys)
        return freed

    def begin_attempt(self, step: int, level: int, capture: bool = True) -> None:
        """Select `level`'s bank for an attempt of a step; it records (to be captured after
        the step) if it has no graphs yet, the warmup is over and `capture` (else an
        uncaptured bank runs eagerly)."""
        bank = self.select(level)
        bank.recording = capture and not bank.captured and step >= self.warmup_steps
        if bank.recording:
            self._due.setdefault(self.key(level), level)

    def end_attempt(self) -> None:
        self.banks.active.recording = False

    def run(self, inputs, eager_run):
        """The plan over `inputs`: by the full-iteration bank, else eagerly (the executor then
        asks the per-layer bank in use for each node's callable)."""
        if self.full_iteration:
            return self.banks.active.run(inputs)
        if isinstance(self.banks.active, SizeBanks):
            self.banks.active.route(inputs)
        return eager_run(inputs)

    @property
    def due(self) -> bool:
        """Whether this step recorded a bank that `capture_due` will capture."""
        return bool(self._due)

    def capture_due(self, plan, select_level) -> list[tuple[int, object]]:
        """Capture every bank recorded in this step, each with the budget at its level
        (`select_level(level)` sets it); -> [(level, bank)]. Leaves level 0 selected, and
        nothing due, also when a capture raised."""
        captured = []
        try:
            for key, level in self._due.items():
                select_level(level)
                bank = self.banks.select(key, self.make_bank)
                bank.capture(plan)
                if not isinstance(bank, SizeBanks) or bank.captured_now:  # (sizes may wait)
                    captured.append((level, bank))
        finally:
            self._due.clear()
            select_level(0)
            self.select(0)
        return captured

    def release(self) -> None:
        """Release every bank of the run, every path's (the budget they were sized by changed,
        or the run goes on without graphs)."""
        self.banks.release()
