"""The tables and the plot of benchmarks/scale.md: `python -m benchmarks.harness.sim_report [--plot
PNG]`.

Every row is one `epoverlap-simulate` scenario, printed with its flags, run through the same
functions the command runs; measured figures are read from benchmarks/data/*.json (the overlap
benchmark's runs), benchmarks/timelines/ (its span summaries and trace) and
tests/fixtures/sim_cpu_tiny/ (a recorded 2-rank gloo run). Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.harness.bench_overlap import SHAPES
from epoverlap.cli import simulate as sim

ROOT = Path(__file__).resolve().parents[2]
DATA, TIMELINES = ROOT / "benchmarks" / "data", ROOT / "benchmarks" / "timelines"
TRACE = "benchmarks/timelines/trace_2gpu_ovl.json"
CPU_RUN = "tests/fixtures/sim_cpu_tiny"
# The x4 host runs the same 1-GPU training step in 88.9 ms, the x2 host (where the trace was
# recorded) in 149.6 ms (benchmarks/baseline.md): host launch costs measured on the x2 host are
# scaled by this for the runs of the x4 host.
X4_HOST = round(88.9 / 149.6, 3)
EAGER = ["--host-from", TRACE]
EAGER_X4 = EAGER + ["--host-scale", str(X4_HOST)]
MODES = ("seq", "ovl", "wgrad", "comp")


def measured(name: str) -> dict:
    """shape -> {mode: fb ms} of one benchmark JSON (comm = T_comm)."""
    out = {}
    for row in json.loads((DATA / name).read_text())["results"]:
        out[row["shape"]] = {("wgrad" if k == "ovl_wgrad" else k): v["fb_ms"]
                             for k, v in row.items() if isinstance(v, dict) and "fb_ms" in v}
    return out


RUN_A, RUN_B, RUN_4 = (measured("bench_overlap_2gpu.json"),
                       measured("bench_overlap_2gpu_h200x2.json"),
                       measured("bench_overlap_4gpu.json"))


def parse(flags: list[str]):
    """The simulator's arguments, with `--shape NAME` standing for a bench_overlap shape's
    training flags (bf16), which the simulator takes after `--`."""
    flags = list(flags)
    train = flags[flags.index("--") + 1:] if "--" in flags else []
    flags = flags[:flags.index("--")] if "--" in flags else flags
    if "--shape" in flags:
        at = flags.index("--shape")
        train = [*SHAPES[flags[at + 1]], "--bf16", *train]
        del flags[at:at + 2]
    if "--kernel-backend" not in train:  # the simulator runs no kernel; this runs on any host
        train += ["--kernel-backend", "torch"]
    return sim.parse_args([*flags, "--", *train])


def scenario(flags: list[str], **kwargs):
    return sim.build_scenario(parse(["--no-png", *flags]), **kwargs)


def simulate(flags: list[str], **kwargs) -> dict:
    """Figures (ms) of one scenario, and its overlapped step's exposed comm per layer."""
    s = scenario(flags, **kwargs)
    results = sim.run_all(s)
    layers = sim.layer_exposure(results["ovl"], s.ep)
    return {**sim.figures(results, sim.t_comm_us(s)),
            "exposed_layer_ms": statistics.fmean(e["exposed_comm_us"] for e in layers)}


def cmd(flags: list[str]) -> str:
    return "`epoverlap-simulate " + " ".join(flags) + "`"


def err(sim_ms: float, real_ms: float) -> str:
    return f"{sim_ms:.1f} / {real_ms:.1f} ({sim_ms / real_ms - 1:+.0%})"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


# ---------------------------------------------------------------------------- validation
def cpu_rows() -> str:
    rows = []
    for mode in ("seq", "ovl", "wgrad"):
        for link in ("measured", "fit"):
            flags = ["--spans", f"{CPU_RUN}/{mode}", "--link", link, "--", "--preset", "tiny"]
            replay = sim.replay_steps(scenario(flags))
            m = statistics.fmean(r["measured_ms"] for r in replay)
            s = statistics.fmean(r["simulated_ms"] for r in replay)
            steps = ", ".join(f"{r['error']:+.1%}" for r in replay)
            rows.append([mode, link, f"{m:.1f}", f"{s:.1f}", f"{s / m - 1:+.1%}", steps,
                         cmd(flags)])
    return table(["recorded mode", "comm", "measured ms (mean of 3 steps)", "simulated ms",
                  "error", "per step", "command"], rows)


def comm_rows() -> str:
    rows = []
    for shape in ("ratio_h2048_k8_f128", "ratio_h2048_k8_f256", "ratio_h4096_k8_f256",
                  "dsv3_layer"):
        for ep, runs in ((2, (RUN_A, RUN_B)), (4, (RUN_4,))):
            flags = ["--flops", "--shape", shape, "--ep", str(ep), "--link", "nvlink"]
            t = simulate(flags)["T_comm_ms"]
            real = [run[shape]["comm"] for run in runs]
            rows.append([shape, ep, f"{t:.1f}", " / ".join(f"{r:.1f}" for r in real),
                         f"{t / statistics.fmean(real) - 1:+.0%}"])
    return table(["shape", "EP", "simulated T_comm ms", "measured (run A / run B, or 4 GPUs)",
                  "error"], rows)


def trace_rows() -> str:
    """The recorded 2-GPU overlapped steps (run B, f128) replayed, and its bench figures."""
    base = ["--trace", TRACE, "--shape", "ratio_h2048_k8_f128"]
    rows = []
    for link, host in (("measured", []), ("measured", EAGER), ("nvlink", EAGER)):
        flags = base + ["--link", link] + host
        s = scenario(flags)
        replay = sim.replay_steps(s)
        fig = sim.figures(sim.run_all(s), sim.t_comm_us(s))
        m = statistics.fmean(r["measured_ms"] for r in replay)
        p = statistics.fmean(r["simulated_ms"] for r in replay)
        b = RUN_B["ratio_h2048_k8_f128"]
        rows.append([link, "eager (gaps)" if host else "none", err(p, m),
                     err(fig["T_ovl_ms"], b["ovl"]), err(fig["T_comp_ms"], b["comp"]),
                     err(fig["T_seq_ms"], b["seq"]), cmd(flags)])
    return table(["comm", "host launch cost", "profiled steps: sim / measured ms",
                  "T_ovl", "T_comp", "T_seq", "command"], rows)


def busy_ratio(summary_a: str, summary_b: str) -> dict:
    """Per (rank, layer): compute busy of summary_a over summary_b (timeline summaries)."""
    def per_layer(name):
        doc = json.loads((TIMELINES / name).read_text())["spans"]
        rows = doc.get("mean_over_steps") or doc["steps"][0]["ranks"]
        return {(row["rank"], e["layer"]): e["compute_busy_us"] for row in rows
                for e in row["layers"]}
    a, b = per_layer(summary_a), per_layer(summary_b)
    return {key: a[key] / b[(key[0] % 2, key[1])] for key in a}


class _Scaled:
    """A compute source scaled per (rank, layer)."""

    def __init__(self, source, ratio):
        self.source, self.ratio, self.wgrad_recorded = source, ratio, source.wgrad_recorded

    def for_plan(self, delay):
        inner = self.source.for_plan(delay)
        return lambda r, a: inner(r, a) * self.ratio[(r, a.layer)]


def scaled_trace_rows() -> str:
    """The 2-GPU trace's compute scaled to another run's measured compute busy per layer."""
    rows = []
    cases = [("seq, 2 GPUs (run B)", 2, "summary_2gpu_seq.json", [], RUN_B, "seq"),
             ("ovl, 4 GPUs (x4 host)", 4, "summary_4gpu_ovl.json", EAGER_X4, RUN_4, "ovl")]
    for label, ep, summary, host, run, mode in cases:
        flags = ["--trace", TRACE, "--shape", "ratio_h2048_k8_f128", "--ep", str(ep),
                 "--link", "nvlink"] + host
        s = scenario(flags)
        s.compute = _Scaled(s.compute, busy_ratio(summary, "summary_2gpu_ovl.json"))
        s.starts = None
        result = sim.run_mode(s, mode)
        rows.append([label, summary, err(result.step_us / 1e3,
                                         run["ratio_h2048_k8_f128"][mode]), cmd(flags)])
    return table(["run", "compute scaled per layer to", "T sim / measured ms",
                  "command (plus the scaling)"], rows)


def flop_rows() -> str:
    rows = []
    cases = [("dsv3_layer", "comp", 4, (2, RUN_A), (4, RUN_4))]
    cases += [(shape, "seq", 2, (2, RUN_A), (4, RUN_4)) for shape in
              ("megatron_e32_k4_mbs2x8", "megatron_e32_k4_mbs8x4", "megatron_e8_k8_f4096_mbs8x4")]
    for shape, mode, at, *points in cases:
        for ep, run in points:
            calib = ["--calibrate", f"{mode}:{run_at(shape, at)[mode]:.2f}@{at}"]
            flags = ["--flops", "--shape", shape, "--ep", str(ep), "--link", "nvlink",
                     *EAGER_X4, *calib]
            try:
                fig = simulate(flags)
            except sim.SimInputError as error:
                rows.append([shape, ep, f"calibration impossible: {error}", "", "", "", ""])
                continue
            real = run[shape]
            cells = [err(fig[f"T_{m}_ms"], real[m]) if m in real else "-" for m in MODES]
            rows.append([shape, ep, *cells, cmd(flags)])
    return table(["shape", "EP", "T_seq sim / measured", "T_ovl", "T_wgrad", "T_comp",
                  "command"], rows)


def run_at(shape: str, ep: int) -> dict:
    return (RUN_A if ep == 2 else RUN_4)[shape]


# ---------------------------------------------------------------------------- predictions
DSV3_RATES: list[str] = []


def dsv3_rates() -> list[str]:
    """The FLOP rates that reproduce dsv3_layer's measured T_comp at EP 4 (eager, x4 host)."""
    if not DSV3_RATES:
        args = parse(["--flops", "--shape", "dsv3_layer", "--link", "nvlink",
                               *EAGER_X4, "--calibrate",
                               f"comp:{RUN_4['dsv3_layer']['comp']:.2f}@4"])
        rate = sim.calibrated_throughput(args)
        DSV3_RATES.extend(["--gemm-tflops", f"{rate.gemm_tflops:.0f}", "--attn-tflops",
                           f"{rate.attn_tflops:.0f}", "--hbm-gbs", f"{rate.hbm_gbs:.0f}"])
    return DSV3_RATES


HOSTS = {"eager": EAGER_X4, "attn graphed": EAGER_X4 + ["--graphed-nodes", "attn"],
         "no host cost": []}


def prediction_rows(cases) -> tuple[str, list[dict]]:
    rows, points = [], []
    for label, flags_base, train in cases:
        for host, host_flags in HOSTS.items():
            flags = flags_base + host_flags + (["--", *train] if train else [])
            fig = simulate(flags)
            points.append({"label": label, "host": host, **fig})
            rows.append([label, host, *(f"{fig[f'T_{m}_ms']:.1f}" for m in MODES),
                         f"{fig['T_comm_ms']:.1f}", f"{fig['T_comm_ms'] / fig['T_comp_ms']:.2f}",
                         f"{fig['ovl_over_max']:.2f}", f"{fig['exposed_layer_ms']:.1f}",
                         f"{fig['T_wgrad_ms'] / max(fig['T_comp_ms'], fig['T_comm_ms']):.2f}",
                         f"{fig['realized_share_ovl']:.2f} / {fig['realized_share_wgrad']:.2f}",
                         cmd(flags)])
    header = ["case", "host", "T_seq ms", "T_ovl", "T_wgrad", "T_comp", "T_comm",
              "comm/comp", "T_ovl/max", "exposed comm per layer (ovl)", "T_wgrad/max",
              "share ovl / wgrad", "command"]
    return table(header, rows), points


FLAT = ["--moe-dispatch-hierarchy", "flat"]  # over nodes the default is by host where it pays
BY_HOST = ["--moe-dispatch-hierarchy", "node"]


def dsv3_cases() -> list:
    ib = ["--link", "ib"]
    cases = [(f"dsv3_layer EP {ep}", ["--flops", "--shape", "dsv3_layer", "--ep", str(ep),
                                      *ib, *dsv3_rates()], FLAT) for ep in (16, 64, 256)]
    cases.append(("dsv3_layer EP 64, imbalance 1.5",
                  ["--flops", "--shape", "dsv3_layer", "--ep", "64", *ib, "--imbalance", "1.5",
                   *dsv3_rates()], FLAT))
    cases.append(("DSv3 layers, 4 layers x 8 microbatches, EP 64",
                  ["--flops", "--shape", "dsv3_layer", "--ep", "64", *ib, *dsv3_rates()],
                  ["--num-layers", "4", "--num-microbatches", "8", *FLAT]))
    return cases


def by_host_cases() -> list:
    """The DSv3 layer over 400 Gb/s nodes of 8 GPUs, flat against the hierarchical dispatch."""
    return [(f"dsv3_layer EP {ep}, {name}", ["--flops", "--shape", "dsv3_layer", "--ep",
                                              str(ep), "--link", "ib", *dsv3_rates()], train)
            for ep in (16, 64, 256) for name, train in (("flat", FLAT), ("by host", BY_HOST))]


def megatron_cases() -> list:
    cases = []
    for shape, eps in (("megatron_e32_k4_mbs2x8", (16, 32)), ("megatron_e32_k4_mbs8x4", (16, 32)),
                       ("megatron_e8_k8_f4096_mbs8x4", (8,))):
        rate = megatron_rates(shape)
        for ep in eps:
            link = ["--link", "ib"] if ep > 8 else ["--link", "nvlink"]
            cases.append((f"{shape} EP {ep}", ["--flops", "--shape", shape, "--ep", str(ep),
                                                *link, *rate], FLAT if ep > 8 else []))
    return cases


def megatron_rates(shape: str) -> list[str]:
    """Rates calibrated on the shape's measured T_seq at EP 2 (eager, x4 host)."""
    args = parse(["--flops", "--shape", shape, "--link", "nvlink", *EAGER_X4,
                           "--calibrate", f"seq:{RUN_A[shape]['seq']:.2f}@2"])
    try:
        rate = sim.calibrated_throughput(args)
    except sim.SimInputError:
        rate = sim.calibrated_throughput(argparse.Namespace(**{**vars(args), "calibrate": None}))
    return ["--gemm-tflops", f"{rate.gemm_tflops:.0f}", "--attn-tflops",
            f"{rate.attn_tflops:.0f}", "--hbm-gbs", f"{rate.hbm_gbs:.0f}"]


def plot(points: list[dict], path: Path) -> None:
    """T/max and comm:compute of the DSv3 layer against EP (eager host; the graphed and
    host-free variants coincide there: the layer is GPU-bound)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    eps = [16, 64, 256]
    own = {p["label"]: p for p in points if p["host"] == "eager"}
    rows = [own[f"dsv3_layer EP {ep}"] for ep in eps]
    ideal = [max(r["T_comp_ms"], r["T_comm_ms"]) for r in rows]
    axes[0].plot(eps, [r["T_seq_ms"] / i for r, i in zip(rows, ideal)], "o-", label="sequential")
    axes[0].plot(eps, [r["T_ovl_ms"] / i for r, i in zip(rows, ideal)], "s-", label="overlap")
    axes[0].plot(eps, [r["T_wgrad_ms"] / i for r, i in zip(rows, ideal)], "^-",
                 label="overlap + delayed wgrad")
    steady = own["DSv3 layers, 4 layers x 8 microbatches, EP 64"]
    best = max(steady["T_comp_ms"], steady["T_comm_ms"])
    axes[0].plot([64], [steady["T_ovl_ms"] / best], "s", color="k", fillstyle="none",
                 label="overlap, 4 layers x 8 microbatches")
    axes[0].plot([64], [steady["T_wgrad_ms"] / best], "^", color="k", fillstyle="none",
                 label="+ delayed wgrad, 4 layers x 8 microbatches")
    axes[1].plot(eps, [r["T_comm_ms"] / r["T_comp_ms"] for r in rows], "o-")
    axes[0].set(xscale="log", xlabel="EP (400 Gb/s InfiniBand, 8 GPUs per node)",
                ylabel="T / max(T_comp, T_comm)",
                title="DSv3 layer (1 layer x 4 microbatches), simulated")
    axes[1].set(xscale="log", xlabel="EP", ylabel="T_comm / T_comp", title="comm : compute")
    for ax in axes:
        ax.minorticks_off()
        ax.set_xticks(eps, [str(e) for e in eps])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", help="write the prediction plot here (PNG)")
    parser.add_argument("--part", choices=["all", "validation", "predictions"], default="all")
    args = parser.parse_args(argv)
    if args.part in ("all", "validation"):
        print("## CPU recorded run\n\n" + cpu_rows() + "\n")
        print("## NVLink all-to-all model\n\n" + comm_rows() + "\n")
        print("## 2-GPU trace replay\n\n" + trace_rows() + "\n")
        print("## trace compute scaled to other runs\n\n" + scaled_trace_rows() + "\n")
        print("## FLOP model\n\n" + flop_rows() + "\n")
    if args.part in ("all", "predictions"):
        text, points = prediction_rows(dsv3_cases())
        print("## DSv3 predictions\n\n" + text + "\n")
        print("## Megatron predictions\n\n" + prediction_rows(megatron_cases())[0] + "\n")
        print("## DSv3, flat and by host\n\n" + prediction_rows(by_host_cases())[0] + "\n")
        if args.plot:
            plot(points, Path(args.plot))
            print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
