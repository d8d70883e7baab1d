"""Memory estimate (training/setup/memory.py): above every peak measured on H200s and at most 1.45x
of it; refusals name the flags that drive it; the host's available memory read right. The
`gpu` test checks it against a run here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from epoverlap.config import parse_config, resolve_config
from epoverlap.errors import ConfigError
from epoverlap.training.setup import memory
from epoverlap.training.setup.memory import GIB, check_memory, estimate_memory
from job_control import REPO, job_env

from benchmarks.harness import train_bench

MODES = {"seq": ["--no-overlap-moe-expert-parallel-comm"],
         "ovl": ["--overlap-moe-expert-parallel-comm"],
         "ovl_wgrad": ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"],
         "comp": ["--overlap-moe-expert-parallel-comm", "--comm-mode", "local_copy"]}
HONEST = 1.45  # the estimate may exceed a measured peak by at most this factor


@pytest.fixture
def unpaired(monkeypatch):
    """The runs below were measured before the experts' weight grads were paired over
    microbatches (session 68): their estimate is the code's of then."""
    monkeypatch.setattr(memory, "expert_grad_placement",
                        lambda cfg: {"first_write": False, "pair_microbatches": False})


def _measured_peaks():
    """(flags, world, peak GiB) of every mode of every shape in benchmarks/data."""
    for path in sorted((REPO / "benchmarks" / "data").glob("bench_overlap_*.json")):
        report = json.loads(path.read_text())
        for shape in report["results"]:
            for mode, extra in MODES.items():
                if "peak_gib" in shape.get(mode, {}):
                    yield (path.name, shape["shape"], mode), shape["flags"] + extra, \
                        report["world"], shape[mode]["peak_gib"]


def test_estimate_bounds_every_peak_measured_on_h200s(unpaired):
    rows = list(_measured_peaks())
    assert len(rows) >= 50
    for where, flags, world, peak_gib in rows:
        estimate = estimate_memory(train_bench.parse_config(flags), world).total / GIB
        assert peak_gib <= estimate <= HONEST * peak_gib, (where, peak_gib, estimate)


def test_estimate_bounds_the_paired_ends_peaks_measured_on_h200s(unpaired):
    """benchmarks/overlap.md run E: the paired-ends plan holds a microbatch more (peaks 23-24
    GiB where the combined 1F1B's were 16-17 at ratio_h2048_k4_f4096); counted, not missed."""
    folder = (REPO / "benchmarks" / "data" / "comm_heavy_carveout_paired_ends_2gpu_2026-11-23"
              / "call5_paired")
    rows = []
    for path in sorted(folder.glob("*.json")):
        report = json.loads(path.read_text())
        for shape in report["results"]:
            for mode in ("seq", "ovl", "ovl_wgrad"):
                rows.append((path.name, mode, shape["flags"] + MODES[mode], report["world"],
                             shape[mode]["peak_gib"]))
    assert sum("paired" in name for name, *_ in rows) >= 9
    for name, mode, flags, world, peak_gib in rows:
        estimate = estimate_memory(train_bench.parse_config(flags), world).total / GIB
        assert peak_gib <= estimate <= HONEST * peak_gib, (name, mode, peak_gib, estimate)


def test_estimate_bounds_the_baseline_runs_with_the_optimizer(unpaired):
    # benchmarks/baseline.md: --preset small --bf16 on H200s, AdamW on, peak GiB per GPU;
    # balanced routing (at 2 GPUs the learned router's imbalance 8.0 peaked at 3.38 GiB, 6%
    # above the estimate: the estimate assumes balanced routing, see training/setup/memory.py)
    for gpus, peak_gib in ((1, 4.76), (2, 3.13)):
        cfg = parse_config(["--preset", "small", "--bf16", "--expert-model-parallel-size",
                            str(gpus)])
        estimate = estimate_memory(cfg, gpus).total / GIB
        assert peak_gib <= estimate <= HONEST * peak_gib, (gpus, peak_gib, estimate)


def test_overlap_and_optimizer_state_are_counted():
    base = ["--preset", "small", "--expert-model-parallel-size", "2"]
    seq = estimate_memory(parse_config(base), 2)
    ovl = estimate_memory(parse_config(base + ["--overlap-moe-expert-parallel-comm"]), 2)
    assert ovl.activations > seq.activations and ovl.states == seq.states
    no_adam = estimate_memory(parse_config(base + ["--skip-optimizer-step"]), 2)
    assert seq.states == no_adam.states * 16 // 8  # fp32: 4 weight + 4 grad + 8 AdamW vs 8


def test_paired_expert_weight_grads_are_counted(monkeypatch):
    """Pairing holds one microbatch's expert rows a MoE layer: b x k x (2H + 3Fe) a token,
    counted wherever the placement pairs (and only there)."""
    cfg = resolve_config(parse_config(["--preset", "small", "--bf16", "--num-microbatches", "2",
                                       "--cuda-graph-impl", "none"]), 1, True)
    paired = estimate_memory(cfg, 1)
    assert estimate_memory(cfg, 1, paired=True) == paired  # the flags allow it here
    monkeypatch.setattr(memory, "expert_grad_placement",
                        lambda cfg: {"first_write": True, "pair_microbatches": False})
    plain = estimate_memory(cfg, 1)
    assert estimate_memory(cfg, 1, paired=False) == plain
    m, moe = cfg.model, cfg.moe
    tokens = cfg.train.micro_batch_size * m.seq_length
    layers = sum(cfg.moe_layer_pattern())
    held = tokens * layers * 2 * moe.moe_router_topk * (2 * m.hidden_size
                                                        + 3 * moe.moe_ffn_hidden_size)
    assert paired.activations - plain.activations == pytest.approx(
        held * memory.UNCOUNTED_FACTOR, rel=1e-6)
    assert "paired weight grads" in paired.in_flight


def test_query_key_norms_are_counted():
    """--qk-layernorm: two weights [head dim] per layer (16 bytes each element: fp32 weight,
    grad, AdamW moments), and each norm's saved input and fp32 1/rms per head."""
    base = ["--preset", "small", "--expert-model-parallel-size", "2"]
    plain, qk = (estimate_memory(parse_config(base + extra), 2) for extra in ([],
                                                                             ["--qk-layernorm"]))
    m = parse_config(base).model
    assert qk.states - plain.states == m.num_layers * 2 * m.head_dim * 16
    assert qk.activations > plain.activations


def test_fixed_dispatch_buffers_are_counted():
    """Padding to capacity and the dispatch budget move more rows than tokens x topk; a
    capacity without padding, or a budget below the balanced share, does not (balanced)."""
    base = ["--preset", "small", "--expert-model-parallel-size", "4"]

    def moe_rows(extra):
        cfg = parse_config(base + extra)
        return memory.dispatch_rows_per_token(cfg), estimate_memory(cfg, 4).activations
    topk = parse_config(base).moe.moe_router_topk
    dropless = moe_rows([])
    assert dropless[0] == topk
    assert moe_rows(["--moe-expert-capacity-factor", "1"]) == dropless
    assert moe_rows(["--moe-dispatch-budget", "0.5"]) == dropless  # reruns at 1.0 when balanced
    for extra, rows in ((["--moe-expert-capacity-factor", "2",
                          "--moe-pad-expert-input-to-capacity"], 2 * topk),
                        (["--moe-dispatch-budget", "1.5"], 1.5 * topk)):
        padded = moe_rows(extra)
        assert padded[0] == rows and padded[1] > dropless[1], extra


def test_mem_available_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    assert memory._mem_available_bytes(str(meminfo)) == 20000000 * 1024
    assert memory._mem_available_bytes(str(tmp_path / "none")) is None


@pytest.mark.parametrize("flags, named", [
    (["--seq-length", "65536", "--micro-batch-size", "8"], "--seq-length=65536"),
    (["--num-layers", "64", "--hidden-size", "4096", "--num-attention-heads", "32"],
     "--hidden-size=4096"),
])
def test_refusal_names_the_flags_that_drive_the_estimate(monkeypatch, flags, named):
    monkeypatch.setattr(memory, "_mem_available_bytes", lambda path="": 8 * GIB)
    cfg = parse_config(["--preset", "tiny"] + flags)
    with pytest.raises(ConfigError) as info:
        check_memory(cfg, 2, "cpu", local_ranks=2)
    message = str(info.value)
    assert message.startswith(named + ": needs about"), message
    assert "8.0 GiB available (/proc/meminfo) for 2 rank(s)" in message
    assert "\n" not in message
    check_memory(parse_config(["--preset", "tiny"]), 2, "cpu", local_ranks=2)  # fits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype_flags", [["--bf16"], ["--no-bf16"]])
def test_estimate_bounds_a_measured_gpu_peak(tmp_path, dtype_flags):
    """One GPU, --preset small (shorter sequences), AdamW on, eager (the estimate counts no
    CUDA graph pool): the per-step peak of max_memory_allocated is below the estimate, and the
    estimate within 1.45x of it."""
    flags = ["--preset", "small", "--seq-length", "512", "--train-iters", "3",
             "--mock-data", "--cuda-graph-impl", "none", *dtype_flags]
    log = tmp_path / "log.jsonl"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node=1", "-m", "epoverlap.train", *flags,
                             "--log-json", str(log)], capture_output=True, text=True,
                            env=job_env(), cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    peak_gib = max(json.loads(line)["peak_mem_gib"] for line in log.read_text().splitlines())
    estimate = estimate_memory(resolve_config(parse_config(flags), 1, True), 1).total / GIB
    assert peak_gib <= estimate <= HONEST * peak_gib, (peak_gib, estimate)
