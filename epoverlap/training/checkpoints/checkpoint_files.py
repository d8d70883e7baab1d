"""Checkpoint folders on disk: names, atomic publishing, finding the newest complete one, and
checking its files. Needs no process group, so a bad --load is refused before one exists.

    SAVE/iter_0000010/            one complete checkpoint (renamed into place only when complete)
        .metadata                 torch.distributed.checkpoint's index: every key, its global
                                  shape, the file and byte range holding it
        __R_0.distcp              the data written by rank R
        meta.json                 format, step, the world/EP layout, the config it was written with
    SAVE/.tmp-iter_0000010/       a save in progress, or one cut off: never loaded
    SAVE/latest_checkpointed_iteration.txt   the newest step published, written last (for people
                                  and tools; loading scans for the newest complete folder itself)

Publishing: every rank writes and fsyncs its data file into the temp folder (DCP does, with
sync_files), DCP's coordinator writes `.metadata` the same way; then rank 0 writes and fsyncs
meta.json, fsyncs the folder, renames it to its final name and fsyncs the parent. A folder named
iter_* exists only once complete, so a save cut off at any point leaves the previous checkpoint
the newest. Every file must sit on a file system all ranks see (as for DCP itself).

Checks (`read_checkpoint`, on every rank alike): meta.json parses and has this format; .metadata
unpickles; every data file it names exists and holds the byte ranges it lists. Bit flips inside a
data file are not detected here (no checksums): DCP reports what it cannot read when loading.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from epoverlap.errors import CheckpointError

FORMAT = "epoverlap-dcp-1"
META = "meta.json"
DCP_INDEX = ".metadata"
TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"^iter_(\d{7,})$")


@dataclass
class CheckpointRef:
    """A complete checkpoint found by --load, its meta.json and DCP index already read."""

    path: Path
    step: int
    meta: dict
    index: Metadata


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def checkpoint_folder(save_dir: str, step: int) -> Path:
    """Where step `step`'s checkpoint is once published."""
    return Path(save_dir) / iter_name(step)


def temp_folder(save_dir: str, step: int) -> Path:
    return Path(save_dir) / f".tmp-{iter_name(step)}"


def prepare_temp(save_dir: str, step: int) -> Path:
    """Rank 0, before a save: an empty temp folder (a stale one from a cut-off save is removed)."""
    temp = temp_folder(save_dir, step)
    if temp.exists():
        shutil.rmtree(temp)
    temp.mkdir(parents=True)
    return temp


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    """Write a small file through a temp name, fsync it, rename it into place."""
    temp = path.with_name(path.name + ".tmp")
    with open(temp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)


def publish(temp: Path, save_dir: str, step: int, meta: dict) -> Path:
    """Rank 0, after every rank's data is on disk: meta.json, then the rename, then the tracker."""
    _write_durably(temp / META, json.dumps(meta, indent=1, sort_keys=True) + "\n")
    _fsync(temp)
    final = checkpoint_folder(save_dir, step)
    if final.exists():  # the same step saved again (e.g. a run resumed from another folder)
        stale = temp.with_name(f".old-{final.name}")
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        shutil.rmtree(stale)
    temp.rename(final)
    _fsync(final.parent)
    _write_durably(final.parent / TRACKER, f"{step}\n")
    _fsync(final.parent)
    return final


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def is_complete(path: Path) -> bool:
    return (path / META).is_file() and (path / DCP_INDEX).is_file()


def newest_complete(load_dir: str) -> Optional[Path]:
    """DIR itself if it is a checkpoint, else its newest complete iter_* folder (or None)."""
    root = Path(load_dir)
    if is_complete(root):
        return root
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _ITER.match(p.name)) and p.is_dir() and is_complete(p)]
    return max(found)[1] if found else None


def find_resume_checkpoint(load_dir: Optional[str], save_dir: Optional[str]
                           ) -> Optional[CheckpointRef]:
    """What --load resumes from. None when there is nothing yet and --load is --save's folder
    (a job's first start, restarts then find their own checkpoints); an error otherwise."""
    if load_dir is None:
        return None
    path = newest_complete(load_dir)
    if path is None:
        same = save_dir is not None and os.path.abspath(save_dir) == os.path.abspath(load_dir)
        if same:
            return None
        raise CheckpointError(load_dir, load_dir, "no complete checkpoint there (an iter_NNNNNNN "
                              f"folder with {META} and {DCP_INDEX}); to start fresh and save "
                              "there, give the same folder to --save")
    return read_checkpoint(path, load_dir)


def read_checkpoint(path: Path, load_dir: str) -> CheckpointRef:
    meta = _read_meta(path / META, load_dir)
    try:
        index = FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # unpickling a damaged file raises anything
        raise CheckpointError(load_dir, path / DCP_INDEX,
                              f"unreadable ({type(error).__name__}: {first_line(error)})") \
            from None
    _check_data_files(path, index, load_dir)
    return CheckpointRef(path=path, step=meta["step"], meta=meta, index=index)


def _read_meta(path: Path, load_dir: str) -> dict:
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(load_dir, path, f"unreadable ({first_line(error)})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(load_dir, path, f"format {found!r}, expected {FORMAT!r}")
    for key, kind in (("step", int), ("world_size", int), ("ep_size", int), ("config", dict)):
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(load_dir, path, f"has no valid {key!r}")
    return meta


def _check_data_files(path: Path, index: Metadata, load_dir: str) -> None:
    """Every file the index names exists and is long enough for every byte range in it."""
    needed: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(load_dir, file, f"missing (named by {DCP_INDEX})")
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(load_dir, file, f"truncated: {size} bytes, {DCP_INDEX} "
                                  f"expects at least {end}")


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
