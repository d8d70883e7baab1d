"""torch.profiler Chrome traces read for overlap: kernels whose name contains "nccl" are comm,
other kernels compute.

Owns `read_torch_trace` (a trace file, gzipped or not, given as an object or a bare event list,
to its GPU kernels and the rank in its `distributedInfo`), `torch_trace_paths` (files and
directories of them), `device_kernels` (their kernels per file and device), `kernel_metrics`
(a device's window, first kernel start to last kernel end: the overlap figures of
epoverlap/profiling/overlap.py, plus busy time per stream) and `torch_trace_summary` (one
entry per trace file and device), which `epoverlap-timeline --torch-trace` prints and stores.
Bad input raises `InputError` naming the file.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator, Sequence

from epoverlap.profiling.overlap import measure, window_metrics
from epoverlap.profiling.summary import InputError


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    end_us: float
    stream: str
    device: str
    is_comm: bool


def torch_trace_paths(arguments: Sequence[str], skip: Collection[str] = ()) -> list[Path]:
    """Expand --torch-trace arguments: files as given, directories to their *.json(.gz) files
    (but span files and the files named in `skip`: the timeline tool's own outputs)."""
    paths: list[Path] = []
    for argument in arguments:
        path = Path(argument)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.name.endswith((".json", ".json.gz"))
                           and p.name not in skip and not p.name.startswith("spans-rank"))
            if not found:
                raise InputError(f"{path}: no *.json or *.json.gz trace files in this directory")
            paths += found
        else:
            paths.append(path)
    return paths


def read_torch_trace(path: Path) -> tuple[int | None, list[Kernel]]:
    """(rank from distributedInfo if any, GPU kernels) of a trace given as an object or a list."""
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, EOFError) as error:
        raise InputError(f"{path}: cannot read torch trace: {error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: not valid JSON (truncated or corrupt?): {error}") from None
    events = document.get("traceEvents") if isinstance(document, dict) else document
    if not isinstance(events, list):
        raise InputError(f"{path}: expected {{'traceEvents': [...]}} or a list of trace events")
    kernels = [_kernel(event, path) for event in events if _is_kernel(event)]
    if not kernels:
        raise InputError(
            f"{path}: no GPU kernel events (\"cat\": \"kernel\"); was the profiler run with "
            "ProfilerActivity.CUDA?"
        )
    info = document.get("distributedInfo") if isinstance(document, dict) else None
    rank = info.get("rank") if isinstance(info, dict) else None
    return (rank if isinstance(rank, int) else None), kernels


def _is_kernel(event: Any) -> bool:
    return (isinstance(event, dict) and str(event.get("cat", "")).lower() == "kernel"
            and event.get("ph", "X") == "X")


def _kernel(event: dict, path: Path) -> Kernel:
    name, ts, dur = event.get("name", ""), event.get("ts"), event.get("dur")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (ts, dur)):
        raise InputError(f"{path}: kernel event {name!r} lacks numeric 'ts'/'dur'")
    args = event.get("args") if isinstance(event.get("args"), dict) else {}
    stream = args.get("stream", event.get("tid"))
    device = args.get("device", event.get("pid"))
    is_comm = "nccl" in str(name).lower()
    return Kernel(str(name), float(ts), float(ts) + float(dur), str(stream), str(device), is_comm)


def kernel_metrics(kernels: Sequence[Kernel]) -> dict[str, Any]:
    """Window (first kernel start .. last kernel end) metrics, plus busy time per stream."""
    start = min(kernel.start_us for kernel in kernels)
    end = max(kernel.end_us for kernel in kernels)
    compute = [(k.start_us - start, k.end_us - start) for k in kernels if not k.is_comm]
    comm = [(k.start_us - start, k.end_us - start) for k in kernels if k.is_comm]
    figures = window_metrics(compute, comm, 0.0, end - start).as_dict()
    figures["window_us"] = figures.pop("step_time_us")
    streams = []
    for stream in sorted({k.stream for k in kernels}, key=_natural_key):
        own = [k for k in kernels if k.stream == stream]
        comm_count = sum(k.is_comm for k in own)
        kind = "comm" if comm_count == len(own) else "compute" if comm_count == 0 else "mixed"
        busy = measure((k.start_us - start, k.end_us - start) for k in own)
        streams.append({"stream": stream, "kind": kind, "busy_us": busy, "kernels": len(own),
                        "nccl_kernels": comm_count})
    return {**figures, "streams": streams}


def device_kernels(arguments: Sequence[str], skip: Collection[str] = ()
                   ) -> Iterator[tuple[dict[str, Any], list[Kernel]]]:
    """Per (trace file, device): ({file, rank, device}, its kernels); the rank from the trace,
    else the file's order. `skip`: file names a directory argument leaves out
    (torch_trace_paths)."""
    for index, path in enumerate(torch_trace_paths(arguments, skip)):
        rank, kernels = read_torch_trace(path)
        for device in sorted({kernel.device for kernel in kernels}, key=_natural_key):
            yield ({"file": str(path), "rank": index if rank is None else rank,
                    "device": device}, [kernel for kernel in kernels if kernel.device == device])


def torch_trace_summary(arguments: Sequence[str],
                        skip: Collection[str] = ()) -> list[dict[str, Any]]:
    """One entry per (trace file, device) with kernel metrics (`device_kernels`)."""
    return [{**where, **kernel_metrics(own)} for where, own in device_kernels(arguments, skip)]


def _natural_key(text: str) -> tuple[int, Any]:
    return (0, int(text)) if text.lstrip("-").isdigit() else (1, text)
