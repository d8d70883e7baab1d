"""Pipeline stages of the model (pure CPU, one process): each stage builds only its layers
under the whole model's names and values, declares its P2P nodes by kind, and a stage that
cannot fit one rank is refused before any process group, naming the flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epoverlap.config import parse_config, resolve_config
from epoverlap.model.nodes import COMM, RECV, SEND
from epoverlap.model.stages import stage_chunks
from epoverlap.model.transformer import MoEModel
from epoverlap.parallel.comm import ExpertComm, PipelineComm
from epoverlap.parallel.groups import PIPELINE, Group
from epoverlap.parallel.watch import CollectiveWatch
from epoverlap.schedule.plan import stage_layout
from epoverlap.training.setup import memory
from epoverlap.training.setup.memory import estimate_memory, weight_sizes
from epoverlap.kernels import make_moe_ops

REPO = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "8", "--num-experts", "4",
         "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--micro-batch-size", "2",
         "--moe-first-k-dense-replace", "1"]


def _pipeline_group(pp: int) -> Group:
    """A pipeline's Group of `pp` stages with no process group (nothing here sends)."""
    return Group(PIPELINE, tuple(range(pp)), None, CollectiveWatch(0, pp, 60.0, False, None))


def build(argv, stage=0, device="cpu"):
    cfg = parse_config(MODEL + argv)
    pp = cfg.parallel.pipeline_model_parallel_size
    pipe = PipelineComm(_pipeline_group(pp), (16, 32), torch.float32,
                        torch.device(device)) if pp > 1 else None
    return MoEModel(cfg.model, cfg.moe, cfg.model_options(),
                    ExpertComm(None, 1), 0, make_moe_ops("torch"), dtype=torch.float32,
                    device=torch.device(device), stage=stage, pipe=pipe)


@pytest.mark.parametrize("argv, stages", [
    (["--pipeline-model-parallel-size", "2"], 2),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"], 2),
    (["--pipeline-model-parallel-size", "4"], 4)])
def test_stages_together_are_the_whole_model_with_its_names_and_values(argv, stages):
    whole = dict(build([]).named_parameters())
    seen = {}
    for stage in range(stages):
        model = build(argv, stage)
        layers = [int(name) for name in model.layers]
        assert layers == [l for c in stage_chunks(4, stages, len(model.chunks), stage)
                          for l in c.layers]
        assert hasattr(model, "embedding") == (stage == 0)
        assert hasattr(model, "head") == (stage == stages - 1)
        for name, param in model.named_parameters():
            assert name not in seen
            seen[name] = param
            assert torch.equal(param, whole[name]), name
    assert sorted(seen) == sorted(whole)


def test_a_stage_declares_its_pipeline_boundaries_as_p2p_nodes_on_the_comm_lane():
    model = build(["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
                   "2"], stage=1)
    specs = model.node_specs()
    boundaries = [(s.name, s.layer, s.p2p, s.lane) for s in specs if s.p2p]
    assert boundaries == [("recv", 1, RECV, COMM), ("send", 1, SEND, COMM),
                          ("recv", 3, RECV, COMM)]
    assert specs[-1].name == "loss" and specs[-1].loss == "loss"
    chunks = stage_layout([(s.layer, s.kind) for s in specs])
    assert [(c.first_layer, len(c.layers), c.head.p2p, c.tail.p2p) for c in chunks] == \
        [(1, 1, RECV, SEND), (3, 1, RECV, None)]
    recv = specs[0]
    assert recv.inputs == {} and recv.outputs == {"hidden": "hidden.L1"}
    send = next(s for s in specs if s.p2p == SEND)
    assert send.inputs == {"hidden": "hidden.L2"} and send.outputs == {}


def test_a_stage_without_a_pipeline_comm_is_refused():
    cfg = parse_config(MODEL + ["--pipeline-model-parallel-size", "2"])
    with pytest.raises(ValueError, match="needs a PipelineComm"):
        MoEModel(cfg.model, cfg.moe, cfg.model_options(),
                 ExpertComm(None, 1), 0, make_moe_ops("torch"), dtype=torch.float32,
                 device=torch.device("cpu"), stage=0)


@pytest.mark.parametrize("pp, virtual, extra", [(2, 1, []), (4, 1, []), (2, 2, []),
                                                (2, 1, ["--qk-layernorm"])])
def test_the_memory_estimate_counts_exactly_each_stages_parameters(pp, virtual, extra):
    """The estimate's weight count per stage (arithmetic in training/setup/memory.py) against the
    parameters the stage's model really builds."""
    argv = ["--pipeline-model-parallel-size", str(pp)] + (
        ["--num-virtual-stages-per-pipeline-rank", str(virtual)] if virtual > 1 else []) + extra
    cfg = parse_config(MODEL + argv)
    for stage in range(pp):
        elements = sum(p.numel() for p in build(argv, stage).parameters())
        assert sum(weight_sizes(cfg, 1, stage)) == elements, stage


def test_the_memory_estimate_is_the_largest_stage_and_counts_its_microbatches_in_flight():
    base = MODEL + ["--num-microbatches", "8"]
    one = estimate_memory(resolve_config(parse_config(base), 2, False), 2)
    cfg = resolve_config(parse_config(base + ["--pipeline-model-parallel-size", "2"]), 2, False)
    staged = estimate_memory(cfg, 2)
    stages = [memory._stage_estimate(cfg, stage) for stage in (0, 1)]
    assert staged.total == max(stage.total for stage in stages)
    assert staged.states < one.states  # half the layers per rank
    assert "2 microbatches on stage 0" in stages[0].in_flight  # 1F1B: P - p in flight
    assert "1 microbatch on stage 1" in stages[1].in_flight
    assert stages[0].activations > one.activations / 2


def test_a_model_too_large_for_this_host_exits_2_before_any_process_group():
    result = subprocess.run(
        [sys.executable, "-m", "epoverlap.train", "--preset", "tiny", "--mock-data",
         "--num-layers", "64", "--hidden-size", "16384", "--num-attention-heads", "8"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--hidden-size=16384: needs about" in lines[0] \
        and "--pipeline-model-parallel-size" in lines[0], result.stderr
