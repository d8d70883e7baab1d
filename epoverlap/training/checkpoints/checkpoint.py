"""Checkpoint contents: the whole training state as the flat keyed dict that
torch.distributed.checkpoint (DCP) writes and reads; saved every --save-interval steps, loaded
by --load at any expert-parallel (and data-parallel) size, and at any context-parallel size:
nothing is kept per CP rank (a CP group's ranks hold the same dense weights; the data position
is the step). Where the files go and how a save is
made atomic is `checkpoint_files`.

Owns `Checkpointer`. Every rank builds its dict from its live tensors, so DCP writes from them
and reads into them in place; a key several ranks hold (a dense weight, an expert on every
expert-data-parallel replica) is written once. Keys:

  model/NAME                        a dense parameter's fp32 master value (a bf16 run's
                                    parameter is its bf16 rounding, restored from it)
  model/NAME/expert/G               expert G's slice ([H, 2F] or [F, H]) of an expert parameter,
                                    G the global expert index ep_rank * L + e: any EP size
                                    reads the experts it holds by their global index
  optim/NAME/exp_avg[/expert/G]     Adam's moments, split by expert the same way
  optim/NAME/exp_avg_sq[/expert/G]
  optim/NAME/step                   Adam's step count (0-d)
  buffer/NAME.expert_bias           router state of aux-loss-free balancing
  rng/R/torch_cpu, rng/R/cuda       rank R's torch generators
  rng/R/NAME.balancing              rank R's router generator (--moe-router-force-load-balancing)

The embedding and head are saved with the padded vocabulary's rows (--make-vocab-size-divisible-by).
A checkpoint written before the vocabulary was padded holds the real V rows of each: it loads
into the first V rows (weights and moments), the padding rows keeping their zeros.

meta.json holds the step, which is also the data position (a batch is a function of seed, step,
rank and microbatch), the world and EP sizes and the config. Loaded at another world size, rank
r takes the RNG streams of saved rank r % saved_world. There is no loss scale (bf16 needs none).
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from epoverlap.config import RunConfig, flag_of
from epoverlap.errors import CheckpointError
from epoverlap.model.moe import Router
from epoverlap.parallel.groups import ParallelGroups
from epoverlap.parallel.watch import host_list
from epoverlap.training.checkpoints import checkpoint_files as files
from epoverlap.training.optimizer.optim import MixedPrecisionAdamW

MOMENTS = ("exp_avg", "exp_avg_sq")
VOCAB_PARAMS = ("embedding", "head")  # [padded V, H]: their rows are the vocabulary's


@dataclass
class _Trainable:
    name: str
    param: nn.Parameter
    master: torch.Tensor  # the fp32 tensor Adam updates (the parameter itself in fp32 runs)
    expert: bool


def _trainables(model: nn.Module, optimizer: MixedPrecisionAdamW) -> list[_Trainable]:
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if len(named) != len(optimizer.params) or any(
            p is not q for (_, p), q in zip(named, optimizer.params)):
        raise RuntimeError("the optimizer's parameters are not the model's, in order")
    return [_Trainable(name, p, master, getattr(p, "is_expert", False))
            for (name, p), master in zip(named, optimizer.masters)]


def _by_expert(key: str, tensor: torch.Tensor, expert: bool, first_expert: int) -> dict:
    """A tensor's entries: itself, or one per local expert keyed by its global index."""
    if not expert:
        return {key: tensor}
    return {f"{key}/expert/{first_expert + e}": tensor[e] for e in range(tensor.shape[0])}


def _first_rows(tensor: torch.Tensor, rows: Optional[int]) -> torch.Tensor:
    """The tensor itself, or a view of its first `rows` rows."""
    return tensor if rows is None else tensor[:rows]


def _routers(model: nn.Module) -> list[tuple[str, Router]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Router)]


def _rng_states(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    states = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    for name, router in _routers(model):
        if router.balancing_rng is not None:
            states[f"{name}.balancing"] = router.balancing_rng.get_state()
    return states


def _set_rng_states(model: nn.Module, device: torch.device, states: dict) -> None:
    if "torch_cpu" in states:
        torch.set_rng_state(states["torch_cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
    for name, router in _routers(model):
        if f"{name}.balancing" in states:
            router.balancing_rng.set_state(states[f"{name}.balancing"])


class _UnreadableRecord(RuntimeError):
    """args: (data file name, what went wrong); crosses ranks inside DCP's CheckpointException."""


class _NamingReader(FileSystemReader):
    """DCP's file reader, which names the data file it was reading when reading fails."""

    current_file: Optional[str] = None

    def _slice_file(self, file, sinfo):
        self.current_file = sinfo.relative_path
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        except Exception as error:  # a damaged record: torch.load raises anything
            sentence = files.first_line(error).split(". ")[0]
            raise _UnreadableRecord(self.current_file,
                                    f"{type(error).__name__}: {sentence}") from None


@contextmanager
def _single_process_quiet():
    """Without a process group (in-process tests) DCP warns that it assumes one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class Checkpointer:
    """Saves and loads one run's training state (see the module docstring for the keys)."""

    def __init__(self, cfg: RunConfig, groups: ParallelGroups, model: nn.Module,
                 optimizer: MixedPrecisionAdamW, log: Callable[[str], None]):
        self.cfg, self.groups, self.model, self.optimizer, self.log = \
            cfg, groups, model, optimizer, log
        self.trainables = _trainables(model, optimizer)
        self.num_experts = cfg.moe.num_experts or 0
        self.first_expert = groups.ep_rank * self.num_experts // groups.ep_size
        self.last_saved: Optional[tuple[int, str]] = None  # (step, folder) saved or loaded

    def due(self, step: int) -> bool:
        c = self.cfg.checkpoint
        if c.save is None:
            return False
        return step == self.cfg.train.train_iters or bool(c.save_interval
                                                          and step % c.save_interval == 0)

    def _entries(self, with_optimizer: bool,
                 vocab_rows: Optional[int] = None) -> dict[str, torch.Tensor]:
        """model/, optim/ and buffer/ entries: views of this rank's live tensors (of the
        embedding's and head's first `vocab_rows` rows where given: an unpadded checkpoint)."""
        entries: dict[str, torch.Tensor] = {}
        for t in self.trainables:
            rows = vocab_rows if t.name in VOCAB_PARAMS else None
            entries.update(_by_expert(f"model/{t.name}", _first_rows(t.master, rows), t.expert,
                                      self.first_expert))
            if with_optimizer:
                state = self.optimizer.state_of(t.master)
                for moment in MOMENTS:
                    entries.update(_by_expert(f"optim/{t.name}/{moment}",
                                              _first_rows(state[moment], rows), t.expert,
                                              self.first_expert))
                entries[f"optim/{t.name}/step"] = state["step"]
        for name, router in _routers(self.model):
            if router.expert_bias is not None:
                entries[f"buffer/{name}.expert_bias"] = router.expert_bias
        return entries

    # ------------------------------------------------------------------------------ save
    def save(self, step: int) -> None:
        start, first = time.perf_counter(), self.groups.is_first()
        save_dir = self.cfg.checkpoint.save
        temp = files.temp_folder(save_dir, step)
        if first:
            files.prepare_temp(save_dir, step)
        self._barrier()
        with_optimizer = bool(self.optimizer.state_of(self.trainables[0].master))
        entries = self._entries(with_optimizer)
        rank = self.groups.rank
        entries.update({f"rng/{rank}/{name}": state for name, state
                        in _rng_states(self.model, self.groups.device).items()})
        with _single_process_quiet():
            dcp.save(entries, storage_writer=FileSystemWriter(str(temp), sync_files=True),
                     no_dist=not dist.is_initialized())
        final = files.checkpoint_folder(save_dir, step)
        if first:
            files.publish(temp, save_dir, step, self._meta(step, with_optimizer))
            size = files.folder_bytes(final)
        self._barrier()
        self.last_saved = (step, str(final))
        if first:
            self.log(f"checkpoint: saved step {step} to {final} in "
                     f"{time.perf_counter() - start:.2f} s ({size / 1e6:.1f} MB)")

    def _barrier(self) -> None:
        """Every rank of the world waits here (through the watch, so a rank that never
        arrives is named); nothing to wait for in a world of one."""
        if self.groups.world_size > 1:
            self.groups.world.barrier()

    def _meta(self, step: int, with_optimizer: bool) -> dict:
        g = self.groups
        return {"format": files.FORMAT, "step": step, "world_size": g.world_size,
                "ep_size": g.ep_size, "num_experts": self.num_experts,
                "optimizer_state": with_optimizer, "loss_scale": None,
                "torch_version": torch.__version__, "config": self.cfg.to_dict(),
                "budget_levels": self._budget_levels(), "budget_fit": self._budget_fit()}

    def _budget_levels(self) -> list:
        """The levels --moe-dispatch-budget-memory remembers ([] without it)."""
        budget = getattr(self.model, "dispatch_budget", None)
        return list(budget.recent_levels) if budget is not None else []

    def _budget_fit(self) -> Optional[dict]:
        """The fitted base budget and what it was fitted from (None without
        --moe-dispatch-budget-fit)."""
        budget = getattr(self.model, "dispatch_budget", None)
        return budget.fit_state() if budget is not None else None

    # ------------------------------------------------------------------------------ load
    def resume(self, ref: Optional[files.CheckpointRef]) -> int:
        """The step to continue after: `ref`'s (loaded) or 0. Every rank must have found the
        same checkpoint (they look before any process group exists), which is checked here."""
        step = ref.step if ref is not None else 0
        if self.groups.world_size > 1:
            steps = torch.tensor([step, -step], dtype=torch.int64, device=self.groups.device)
            self.groups.world.all_reduce(steps, op=dist.ReduceOp.MAX)
            newest, minus_oldest = host_list(steps)
            if newest != -minus_oldest:
                raise CheckpointError(self.cfg.checkpoint.load, self.cfg.checkpoint.load,
                                      f"ranks found different checkpoints (steps "
                                      f"{-minus_oldest} to {newest}): every rank must "
                                      "see the same folder (a shared file system)")
        return self.load(ref) if ref is not None else 0

    def load(self, ref: files.CheckpointRef) -> int:
        """Fill the live state from `ref` (experts resharded by global index); return the step
        to continue after: its step, or 0 with --finetune (the weights alone). --no-load-optim
        leaves the optimizer fresh, --no-load-rng the random state --seed gave."""
        start, c = time.perf_counter(), self.cfg.checkpoint
        vocab_rows = self._unpadded_vocab_rows(ref)
        self._check_same_model(ref, vocab_rows)
        with_optimizer = bool(ref.meta.get("optimizer_state")) and not (c.no_load_optim
                                                                          or c.finetune)
        if with_optimizer:
            self.optimizer.create_state()
        entries = self._entries(with_optimizer, vocab_rows)
        rng = {} if c.no_load_rng or c.finetune else self._rng_targets(ref)
        entries.update(rng)
        try:
            with _single_process_quiet():
                dcp.load(entries, storage_reader=_NamingReader(str(ref.path)),
                         no_dist=not dist.is_initialized())
        except CheckpointException as error:
            rank, (exc, _) = sorted(error.failures.items())[0]
            if isinstance(exc, _UnreadableRecord):
                where, detail = ref.path / exc.args[0], exc.args[1]
            else:
                where, detail = ref.path, files.first_line(exc)
            raise CheckpointError(self.cfg.checkpoint.load, where,
                                  f"unreadable on rank {rank} ({detail})") from None
        self.optimizer.copy_masters_to_params()
        self._restore_budget_levels(ref)
        prefix = f"rng/{self.groups.rank % ref.meta['world_size']}/"
        _set_rng_states(self.model, self.groups.device,
                        {key[len(prefix):]: value for key, value in rng.items()})
        self._log_resume(ref, time.perf_counter() - start, vocab_rows)
        if not c.finetune:
            self.last_saved = (ref.step, str(ref.path))
        return 0 if c.finetune else ref.step

    def _restore_budget_levels(self, ref: files.CheckpointRef) -> None:
        """The remembered budget levels and the fitted base budget (at the same EP size), so a
        resumed run starts each step where the saved run would have (a fresh start with
        --finetune)."""
        budget = getattr(self.model, "dispatch_budget", None)
        if budget is not None and not self.cfg.checkpoint.finetune:
            fit = ref.meta.get("budget_fit")
            if fit is not None and ref.meta["ep_size"] == self.groups.ep_size:
                budget.load_fit_state(fit)
            top = len(budget.levels) - 1  # a run resumed at another EP size has other levels
            budget.recent_levels.extend(min(level, top)
                                        for level in ref.meta.get("budget_levels", []))

    def _rng_targets(self, ref: files.CheckpointRef) -> dict[str, torch.Tensor]:
        """Empty tensors for the saved RNG states this rank takes (those the checkpoint has)."""
        prefix = f"rng/{self.groups.rank % ref.meta['world_size']}/"
        saved = ref.index.state_dict_metadata
        targets = {}
        for name, state in _rng_states(self.model, self.groups.device).items():
            meta = saved.get(prefix + name)
            if meta is not None and tuple(getattr(meta, "size", ())) == tuple(state.shape):
                targets[prefix + name] = torch.empty_like(state)
        return targets

    def _unpadded_vocab_rows(self, ref: files.CheckpointRef) -> Optional[int]:
        """The real vocabulary V when `ref` holds the embedding or head with V rows where this
        model pads them to more (a checkpoint written before the vocabulary was padded, or
        with --make-vocab-size-divisible-by 1): they load into the first V rows. Else None."""
        m = self.cfg.model
        if m.padded_vocab_size == m.vocab_size:
            return None
        saved = ref.index.state_dict_metadata
        rows = {tuple(saved[f"model/{name}"].size)[0] for name in VOCAB_PARAMS
                if f"model/{name}" in saved}
        return m.vocab_size if rows == {m.vocab_size} else None

    def _check_same_model(self, ref: files.CheckpointRef,
                          vocab_rows: Optional[int] = None) -> None:
        """The global model/ and buffer/ keys and shapes must match the checkpoint's exactly
        (the embedding and head with `vocab_rows` rows where given). Computed for the whole
        model (every expert), so every rank reaches the same verdict."""
        expected: dict[str, tuple] = {}
        for t in self.trainables:
            if t.expert:
                for g in range(self.num_experts):
                    expected[f"model/{t.name}/expert/{g}"] = tuple(t.master.shape[1:])
            else:
                rows = vocab_rows if t.name in VOCAB_PARAMS else None
                expected[f"model/{t.name}"] = tuple(_first_rows(t.master, rows).shape)
        for key, tensor in self._entries(False).items():
            if key.startswith("buffer/"):
                expected[key] = tuple(tensor.shape)
        saved = {key: tuple(meta.size) for key, meta in ref.index.state_dict_metadata.items()
                 if key.startswith(("model/", "buffer/"))}
        problem = _first_difference(saved, expected)
        if problem:
            raise CheckpointError(self.cfg.checkpoint.load, ref.path,
                                  f"written for another model: {problem}"
                                  f"{_flag_differences(ref.meta['config'], self.cfg)}")

    def _log_resume(self, ref: files.CheckpointRef, seconds: float,
                    vocab_rows: Optional[int]) -> None:
        g, meta = self.groups, ref.meta
        layout = f"world {meta['world_size']}, EP {meta['ep_size']}"
        now = f"world {g.world_size}, EP {g.ep_size}"
        reshard = "" if layout == now else f"; now {now}: experts resharded by global index"
        c = self.cfg.checkpoint
        if c.finetune:
            what = (f"checkpoint: fine-tuning from the weights of {ref.path} (step {ref.step}); "
                    "optimizer, random state and step count start afresh")
        else:
            fresh = [name for name, on in (("optimizer", c.no_load_optim),
                                           ("random state", c.no_load_rng)) if on]
            what = (f"checkpoint: resuming from {ref.path} at step {ref.step}"
                    + (f" ({' and '.join(fresh)} afresh)" if fresh else ""))
        if vocab_rows is not None:
            reshard += (f"; its unpadded vocabulary of {vocab_rows} rows loaded into the first "
                        f"of {self.cfg.model.padded_vocab_size} (--make-vocab-size-divisible-by "
                        f"{self.cfg.model.make_vocab_size_divisible_by}), the padding rows zero")
        self.log(f"{what} (written by {layout}{reshard}; loaded in {seconds:.2f} s)")


def _first_difference(saved: dict, expected: dict) -> Optional[str]:
    for key in sorted(expected.keys() | saved.keys()):
        if key not in saved:
            return f"{key} {list(expected[key])} is not in the checkpoint"
        if key not in expected:
            return f"{key} {list(saved[key])} is in the checkpoint, not in this model"
        if saved[key] != expected[key]:
            return f"{key} is {list(saved[key])} there, {list(expected[key])} here"
    return None


def _flag_differences(saved_config: dict, cfg: RunConfig) -> str:
    """' (flags that differ: --hidden-size 128 -> 64, ...)' over the model and MoE flags."""
    now = cfg.to_dict()
    changes = [f"{flag_of(name)} {saved_config.get(section, {}).get(name)} -> {value}"
               for section in ("model", "moe") for name, value in now[section].items()
               if saved_config.get(section, {}).get(name, value) != value]
    return f" (flags that differ: {', '.join(changes)})" if changes else ""
