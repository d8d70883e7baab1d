"""benchmarks/harness/data_archive.py: an experiment folder's raw files packed into one archive
and back, byte for byte; the summaries left in place; the same files give the same archive."""

from __future__ import annotations

import pytest

from benchmarks.harness import data_archive


def _folder(tmp_path, name="exp"):
    folder = tmp_path / name
    (folder / "call1" / "profile").mkdir(parents=True)
    files = {"summary.md": b"| a |\n", "call1/train_rounds.json": b'{"sides": {}}',
             "call1/default_1.log": b"step 1\n" * 50, "call1/default_1.jsonl": b'{"step": 1}\n',
             "call1/default_1.config.json": b"{}", "call1/profile/spans-rank00000.json": b"[]",
             "call1/profile/timeline_trace.json": b"{}", "tree.diff": b"+x\n"}
    for rel, data in files.items():
        (folder / rel).write_bytes(data)
    return folder, files


def test_pack_keeps_summaries_and_unpack_restores_every_byte(tmp_path):
    folder, files = _folder(tmp_path)
    packed = {str(rel) for rel in data_archive.pack(folder)}
    kept = {"summary.md", "call1/train_rounds.json"}
    assert packed == set(files) - kept
    on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert on_disk == kept | {data_archive.ARCHIVE}
    assert not (folder / "call1" / "profile").exists()
    out = tmp_path / "out"
    data_archive.unpack(folder, out)
    assert {rel: (out / rel).read_bytes() for rel in packed} == {rel: files[rel] for rel in packed}


def test_packing_the_same_files_twice_gives_the_same_bytes(tmp_path):
    one, _ = _folder(tmp_path, "one")
    two, _ = _folder(tmp_path, "two")
    data_archive.pack(one)
    data_archive.pack(two)
    assert (one / data_archive.ARCHIVE).read_bytes() == (two / data_archive.ARCHIVE).read_bytes()


def test_read_text_reads_an_archived_file_by_its_recorded_path(tmp_path):
    folder, files = _folder(tmp_path)
    data_archive.pack(folder)
    assert data_archive.read_text(folder / "call1" / "default_1.log") == files[
        "call1/default_1.log"].decode()
    assert data_archive.read_text(folder / "summary.md") == "| a |\n"
    with pytest.raises(FileNotFoundError, match="missing.log"):
        data_archive.read_text(folder / "call1" / "missing.log")


def test_the_benchmarks_folder_stays_under_10_mb():
    """Reports and their summaries in the tree, raw records packed per experiment: the whole
    of benchmarks/ (less caches) under 10 MB, as the house's layout asks."""
    from pathlib import Path
    root = Path(data_archive.__file__).resolve().parents[1]
    sizes = {p: p.stat().st_size for p in root.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    total = sum(sizes.values())
    largest = sorted(sizes, key=sizes.get, reverse=True)[:3]
    assert total < 10_000_000, (total, [(str(p.relative_to(root)), sizes[p]) for p in largest])
