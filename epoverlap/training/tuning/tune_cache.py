"""The tuner's cache (`--tune-cache DIR`): a decision kept for reruns of the same job.

Owns the key and the files. The key is a sha256 over what decides which path is fastest
(`key_fields`): the model's shape, the MoE fields, the parallel sizes and the world size, the
microbatch size and count, the dtype, the GPU's name and count, the link (NCCL_P2P_DISABLE,
NCCL_SHM_DISABLE, every NCCL_NET* variable, and CUDA peer access between devices 0 and 1 where
there are two), the torch, NCCL and Triton versions, and the flags that shape the step (the
overlap, kernel and CUDA-graph sections, the training flags the step runs with). Left out: the
step count, paths of data, checkpoints and logs, seeds, the learning-rate schedule and
optimizer settings, and the tuning flags themselves. After a decision rank 0 writes
DIR/<key>.json (atomically); a rerun with the same key reads it and skips tuning. A file that
does not parse, or names a path this run does not have, is ignored with a warning.

Files written before the all-to-alls' expert groups were named waves still read: the key keeps
the field's former name (`moe_a2a_chunks`, `_FORMER_FIELDS`), so their keys are this run's, and a
path name's former `+kK` suffix reads as `+wK` (`_current_name`).

Owns `key_fields` and `cache_key`, `read_decision` and `write_decision`, and
`agreed_cached_decision` (rank 0 reads, every rank takes what it read).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

import torch

from epoverlap.config import RunConfig
from epoverlap.model.transformer import model_dtype
from epoverlap.training.telemetry.console import warn_every_rank
from epoverlap.training.tuning.tuner import TuneDecision

VERSION = 1
# training flags that do not change which path is fastest
_TRAIN_LEFT_OUT = ("train_iters", "train_samples", "global_batch_size", "lr", "min_lr",
                   "lr_warmup_iters", "lr_warmup_fraction", "lr_decay_style", "lr_decay_iters",
                   "lr_wsd_decay_style", "lr_wsd_decay_iters", "weight_decay", "adam_beta1",
                   "adam_beta2", "adam_eps", "clip_grad", "seed", "exit_signal_handler",
                   "exit_duration_in_mins", "exit_interval")
_OVERLAP_LEFT_OUT = ("tune", "tune_steps", "tune_cache", "overlap_probe_steps")
LINK_VARIABLES = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")
# overlap fields renamed since caches were first written: their former names stay in the key
_FORMER_FIELDS = {"moe_a2a_waves": "moe_a2a_chunks"}
_FORMER_WAVES = re.compile(r"\+k(\d+)$")  # a path in waves before its rename: `...+k4`


def key_fields(cfg: RunConfig, world_size: int, device: torch.device) -> dict:
    """Everything the key is made of, as JSON-ready values (see the module docstring)."""
    def section(obj, left_out=()) -> dict:
        return {k: v for k, v in dataclasses.asdict(obj).items() if k not in left_out}
    return {"model": section(cfg.model), "moe": section(cfg.moe),
            "parallel": section(cfg.parallel, ("distributed_timeout_minutes",)),
            "train": section(cfg.train, _TRAIN_LEFT_OUT),
            "overlap": {_FORMER_FIELDS.get(k, k): v
                        for k, v in section(cfg.overlap, _OVERLAP_LEFT_OUT).items()},
            "kernels": section(cfg.kernels), "kernel_backend":
            cfg.resolved_kernel_backend(device.type), "cuda_graph": section(cfg.cuda_graph),
            "world_size": world_size, "dtype": str(model_dtype(cfg.train.bf16)),
            "gpus": _gpus(device), "link": _link(device), "versions": _versions()}


def cache_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def _gpus(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": "cpu", "count": 0}
    return {"name": torch.cuda.get_device_name(device), "count": torch.cuda.device_count()}


def _link(device: torch.device) -> dict:
    link = {name: value for name, value in sorted(os.environ.items())
            if name in LINK_VARIABLES or name.startswith("NCCL_NET")}
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        link["peer_access_0_1"] = torch.cuda.can_device_access_peer(0, 1)
    return link


def _versions() -> dict:
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError):
            nccl = None
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    return {"torch": torch.__version__, "nccl": nccl, "triton": triton}


def cache_file(directory: str, key: str) -> Path:
    return Path(directory) / f"{key}.json"


def read_decision(path: Path, names: list[str]) -> tuple[Optional[TuneDecision], Optional[str]]:
    """The decision in `path` if it names one of `names`; -> (decision or None, a warning or
    None). A missing file is no warning."""
    if not path.exists():
        return None, None
    try:
        body = json.loads(path.read_text())
        chosen, rows = _current_name(body["chosen"]), body.get("paths") or {}
        if not isinstance(rows, dict):
            raise ValueError("'paths' is not an object")
        rows = {_current_name(name): row for name, row in rows.items()}
        dropped = {_current_name(name): why for name, why in (body.get("dropped") or {}).items()}
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"tune: ignoring the cache file {path}: it does not parse ({error})"
    if chosen not in names:
        return None, (f"tune: ignoring the cache file {path}: it names {chosen!r}, not a path "
                      f"of this run ({', '.join(names)})")
    return TuneDecision(chosen, [], None, dropped, cache_file=str(path), cached_rows=rows), None


def _current_name(name):
    """A path's name as this version spells it (module docstring); others as they are."""
    return _FORMER_WAVES.sub(r"+w\1", name) if isinstance(name, str) else name


def write_decision(path: Path, decision: TuneDecision, fields: dict) -> Optional[str]:
    """Write the decision to `path` (through a temporary file); -> a warning if it failed."""
    body = {"version": VERSION, "key": path.stem, **decision.record(), "key_fields": fields}
    body["cached"], body["cache_file"] = False, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(body, indent=1, default=str) + "\n")
        os.replace(temporary, path)
    except OSError as error:
        return f"tune: could not write the cache file {path}: {error}"
    return None


@dataclass(frozen=True)
class CacheTarget:
    """Where rank 0 writes this run's decision, and what its key was made of."""

    path: Path
    fields: dict


def agreed_cached_decision(parts, names: list[str]
                           ) -> tuple[Optional[TuneDecision], Optional[CacheTarget]]:
    """--tune-cache: rank 0 reads the decision of this job's key (a warning line for a file it
    ignores) and every rank takes it (one all-reduce; a collective: every rank calls it at the
    same point). -> (the decision or None, rank 0's cache target; None elsewhere)."""
    directory, groups = parts.cfg.overlap.tune_cache, parts.groups
    if directory is None:
        return None, None
    decision, target = None, None
    if groups.is_first():
        fields = key_fields(parts.cfg, groups.world_size, parts.device)
        target = CacheTarget(cache_file(directory, cache_key(fields)), fields)
        decision, warning = read_decision(target.path, names)
        if warning is not None:
            warn_every_rank(warning)
    index = torch.tensor([names.index(decision.chosen) + 1 if decision else 0],
                         dtype=torch.int64, device=parts.device)
    groups.world.all_reduce(index)
    chosen = int(index.item())
    if chosen == 0:
        return None, target
    return decision or TuneDecision(names[chosen - 1], [], cache_file="", cached_rows={}), target
