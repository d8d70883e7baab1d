"""Pipeline stages of the model (pure CPU, one process): each stage builds only its layers
under the whole model's names and values, declares its P2P nodes by kind, and a stage that
cannot fit one rank is refused before any process group, naming the flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epoverlap.config import parse_config
from epoverlap.errors import ConfigError
from epoverlap.model.nodes import COMM, RECV, SEND
from epoverlap.model.stages import stage_chunks
from epoverlap.model.transformer import MoEModel
from epoverlap.parallel.comm import ExpertComm, PipelineComm
from epoverlap.schedule.plan import stage_layout
from epoverlap.training.stage_memory import check_stages_fit, stage_state_bytes
from epoverlap_kernels import make_moe_ops

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "8", "--num-experts", "4",
         "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--micro-batch-size", "2",
         "--moe-first-k-dense-replace", "1"]


def build(argv, stage=0, device="cpu"):
    cfg = parse_config(MODEL + argv)
    pp = cfg.parallel.pipeline_model_parallel_size
    pipe = PipelineComm(None, tuple(range(pp)), (16, 32), torch.float32,
                        torch.device(device)) if pp > 1 else None
    return MoEModel(cfg, ExpertComm(None, 1), 0, make_moe_ops("torch"), dtype=torch.float32,
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
        MoEModel(cfg, ExpertComm(None, 1), 0, make_moe_ops("torch"), dtype=torch.float32,
                 device=torch.device("cpu"), stage=0)


def test_stage_state_bytes_count_the_stage_parameters_and_their_states():
    cfg = parse_config(MODEL + ["--pipeline-model-parallel-size", "2"])
    for stage in (0, 1):
        elements = sum(p.numel() for p in build(["--pipeline-model-parallel-size", "2"],
                                                 stage).parameters())
        assert stage_state_bytes(cfg, stage) == elements * (4 + 4 + 8)  # fp32, grad, 2 moments


def test_a_stage_that_cannot_fit_is_refused_naming_the_flag():
    cfg = parse_config(MODEL + ["--pipeline-model-parallel-size", "2"])
    need = max(stage_state_bytes(cfg, s) for s in (0, 1))
    check_stages_fit(cfg, need)
    check_stages_fit(cfg, None)  # unknown capacity: not checked
    with pytest.raises(ConfigError) as info:
        check_stages_fit(cfg, need - 1)
    message = str(info.value)
    assert message.startswith("--pipeline-model-parallel-size=2: stage ")
    assert "more than the" in message and "use more pipeline stages" in message


def test_a_model_too_large_for_this_host_exits_2_before_any_process_group():
    result = subprocess.run(
        [sys.executable, "-m", "epoverlap.train", "--preset", "tiny", "--mock-data",
         "--num-layers", "64", "--hidden-size", "16384", "--num-attention-heads", "8"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--pipeline-model-parallel-size=1: stage 0 (L0-63) needs" \
        in lines[0], result.stderr
