"""The raw records of one experiment folder under benchmarks/data/ as one compressed archive.

    python -m benchmarks.harness.data_archive pack FOLDER     # raw files -> FOLDER/raw.tar.xz
    python -m benchmarks.harness.data_archive unpack FOLDER [--to DIR]
    python -m benchmarks.harness.data_archive list FOLDER

An experiment folder keeps its summaries in the tree, uncompressed, beside the report that cites
them: JSON (the per-step samples and medians a report's figures come from), markdown tables,
`summary.txt`, `versions.txt`, scripts. Its raw records (step logs, `--log-json` streams, each
run's saved config, span files, traces and their kernel tables, tree diffs, archives) go into
one `raw.tar.xz` under the same relative paths, so `unpack` restores the folder as it was
recorded, and a report's path to a raw file reads as that file's place in its folder's archive.
`read_text` reads such a path from the disk or, where it is not there, from the archive of the
folder above it.

The archive is deterministic (members sorted, times and owners zeroed, xz preset 9e): packing
the same files twice gives the same bytes.
"""

from __future__ import annotations

import argparse
import io
import lzma
import sys
import tarfile
from pathlib import Path

ARCHIVE = "raw.tar.xz"
RAW_SUFFIXES = (".log", ".jsonl", ".diff", ".out", ".xml", ".tgz", ".gz", ".config.json")
RAW_PREFIXES = ("spans", "timeline_trace", "trace", "simulated_trace", "ktable")


def is_raw(name: str) -> bool:
    """Whether a file (by name) is a raw record, archived, rather than a summary kept."""
    return name.endswith(RAW_SUFFIXES) or name.startswith(RAW_PREFIXES)


def raw_files(folder: Path) -> list:
    """The raw files under `folder` (paths relative to it, sorted), the archive left out."""
    return sorted(path.relative_to(folder) for path in folder.rglob("*")
                  if path.is_file() and path.name != ARCHIVE and is_raw(path.name))


def pack(folder: Path) -> list:
    """Move `folder`'s raw files into `folder/raw.tar.xz` (added to an archive already there,
    a member of the same path replaced); empty folders left behind go too. Returns the members
    packed now."""
    members = raw_files(folder)
    if not members:
        return []
    contents = dict(_read_archive(folder / ARCHIVE))
    contents.update({str(rel): (folder / rel).read_bytes() for rel in members})
    (folder / ARCHIVE).write_bytes(_archive_bytes(contents))
    for rel in members:
        (folder / rel).unlink()
    for path in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    return members


def _archive_bytes(contents: dict) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(contents):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(contents[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(contents[name]))
    return lzma.compress(buffer.getvalue(), preset=9 | lzma.PRESET_EXTREME)


def _read_archive(path: Path):
    """(member name, bytes) of every file in the archive at `path` (none where it is absent)."""
    if not path.exists():
        return
    with tarfile.open(path, mode="r:xz") as tar:
        for info in tar.getmembers():
            if info.isfile():
                yield info.name, tar.extractfile(info).read()


def unpack(folder: Path, to: Path = None) -> list:
    """Write `folder`'s archived files under `to` (default: `folder` itself, restoring it as
    recorded). Returns the member names."""
    to = folder if to is None else to
    names = []
    for name, data in _read_archive(folder / ARCHIVE):
        target = to / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        names.append(name)
    return names


def read_text(path: Path) -> str:
    """The text of `path`: from the disk, or else from the nearest folder above it that holds a
    raw.tar.xz with that member. FileNotFoundError names the path where neither has it."""
    path = Path(path)
    if path.exists():
        return path.read_text()
    for folder in path.parents:
        if (folder / ARCHIVE).exists():
            member = path.relative_to(folder).as_posix()
            for name, data in _read_archive(folder / ARCHIVE):
                if name == member:
                    return data.decode()
    raise FileNotFoundError(f"{path}: not on disk, nor in a {ARCHIVE} of a folder above it")


def main(argv: list = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.harness.data_archive",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("pack", "unpack", "list"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--to", type=Path, default=None, help="unpack here (default: FOLDER)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"data_archive: {args.folder}: not a folder", file=sys.stderr)
        return 2
    if args.action == "pack":
        names = [str(rel) for rel in pack(args.folder)]
    elif args.action == "unpack":
        names = unpack(args.folder, args.to)
    else:
        names = [name for name, _ in _read_archive(args.folder / ARCHIVE)]
    print("\n".join(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
