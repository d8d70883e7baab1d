"""The `auto` defaults (config.resolve): resolved alike whichever command starts the job, never
over a value given, and never turning a valid command line into an error."""

from __future__ import annotations

import pytest

from epoverlap.cli.launch import plan_launch
from epoverlap.cli.train import checked_config
from epoverlap.config import parse_config, resolve_config
from epoverlap.config.parse import flags_text
from epoverlap.config.resolve import SEQUENTIAL_FLAG, auto_ep_size, path_text


def resolved(argv, world=2, cuda=False):
    return resolve_config(parse_config(argv), world, cuda)


@pytest.fixture
def gpu_rules(monkeypatch):
    """Resolve as on a GPU machine (the Triton kernels' check passes in interpret mode)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def one_host_over_nvlink(monkeypatch):
    for name in ("NCCL_P2P_DISABLE", "LOCAL_WORLD_SIZE", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)


def test_cpu_ranks_get_ep_over_all_ranks_and_the_overlap_in_fp32_eager():
    cfg = resolved([], world=4)
    assert cfg.parallel.expert_model_parallel_size == 4
    assert cfg.overlap.overlap_moe_expert_parallel_comm is True
    assert cfg.train.bf16 is False
    assert cfg.cuda_graph.impl == "none"


def test_gpus_over_nvlink_get_bf16_and_one_graph_of_the_iteration(gpu_rules, monkeypatch):
    one_host_over_nvlink(monkeypatch)
    cfg = resolved([], world=2, cuda=True)
    assert (cfg.train.bf16, cfg.overlap.overlap_moe_expert_parallel_comm) == (True, True)
    assert (cfg.cuda_graph.impl, cfg.moe.moe_dispatch_budget) == ("full_iteration", 1.25)
    assert (cfg.moe.moe_dispatch_budget_memory, cfg.moe.moe_dispatch_budget_fit) == (20, True)
    assert "--moe-dispatch-budget" in cfg.defaulted
    assert cfg.overlap.overlap_grad_reduce is False  # opt-in (it delays comm-bound steps)


@pytest.mark.parametrize("link", [{"NCCL_P2P_DISABLE": "1"},
                                  {"LOCAL_WORLD_SIZE": "1"},  # two hosts of one rank
                                  {"SLURM_NNODES": "2"}])  # srun without torchrun
def test_where_bytes_bind_gpus_get_partial_graphs(gpu_rules, monkeypatch, link):
    one_host_over_nvlink(monkeypatch)
    for name, value in link.items():
        monkeypatch.setenv(name, value)
    cfg = resolved([], world=2, cuda=True)
    assert (cfg.parallel.expert_model_parallel_size, cfg.train.bf16,
            cfg.overlap.overlap_moe_expert_parallel_comm) == (2, True, True)
    assert cfg.cuda_graph.impl == "local"
    assert cfg.cuda_graph.modules == ("attn", "moe_router", "moe_preprocess")
    assert "--overlap-moe-expert-parallel-comm" in cfg.defaulted


@pytest.mark.parametrize("peer, nvlink, impl, link", [
    (False, None, "local", "link host memory (no peer access between the 2 local GPUs)"),
    (True, False, "local", "link pcie (peer access between the 2 local GPUs, NVLink not on"),
    (True, True, "full_iteration", "link nvlink (peer access between the 2 local GPUs, NVLink"),
    (True, None, "full_iteration", "link peer (peer access between the 2 local GPUs; NVLink "
                                   "unknown: no NVML)")])
def test_the_auto_graphs_follow_the_link_the_hardware_has(gpu_rules, monkeypatch, peer, nvlink,
                                                          impl, link):
    """A PCIe host without peer access, no NCCL variable set, gets the partial graphs; the
    path line names the link found and why."""
    one_host_over_nvlink(monkeypatch)
    monkeypatch.setattr("epoverlap.parallel.link._sees", lambda gpus: True)
    monkeypatch.setattr("epoverlap.parallel.link._peer_access", lambda gpus: peer)
    monkeypatch.setattr("epoverlap.parallel.link._nvlink", lambda gpus: nvlink)
    cfg = resolved([], world=2, cuda=True)
    assert cfg.cuda_graph.impl == impl
    scope = "local (attn moe_router moe_preprocess)" if impl == "local" else impl
    assert f"graphs {scope} | {link}" in path_text(cfg, "cuda")
    assert resolve_config(cfg, 2, True) == cfg


def test_values_given_are_kept(gpu_rules):
    cfg = resolved(["--no-bf16", "--cuda-graph-impl", "none", SEQUENTIAL_FLAG,
                    "--expert-model-parallel-size", "1"], world=2, cuda=True)
    assert (cfg.parallel.expert_model_parallel_size, cfg.train.bf16,
            cfg.overlap.overlap_moe_expert_parallel_comm, cfg.cuda_graph.impl) == \
        (1, False, False, "none")
    assert cfg.defaulted == ()
    assert "--no-bf16" in flags_text(cfg) and SEQUENTIAL_FLAG in flags_text(cfg)


@pytest.mark.parametrize("argv, beside", [
    ([], False), (["--overlap-grad-reduce"], True)])
def test_the_grad_reduce_goes_beside_the_backward_only_when_asked(argv, beside):
    cfg = resolved(argv + ["--num-layers", "2"], world=4)
    assert cfg.overlap.overlap_grad_reduce is beside
    assert "--overlap-grad-reduce" not in cfg.defaulted


def test_one_ep_rank_has_nothing_to_overlap():
    cfg = resolved(["--expert-model-parallel-size", "1"], world=2)
    assert cfg.overlap.overlap_moe_expert_parallel_comm is False


def test_an_auto_value_a_rule_refuses_falls_back_to_off(gpu_rules):
    # the graphs capture one-stage plans: with pipeline stages the auto graphs stay off
    cfg = resolved(["--pipeline-model-parallel-size", "2"], world=4, cuda=True)
    assert cfg.cuda_graph.impl == "none"
    assert cfg.overlap.overlap_moe_expert_parallel_comm is True


@pytest.mark.parametrize("experts, world, pp, ep", [(8, 4, 1, 4), (6, 4, 1, 2), (8, 8, 2, 4),
                                                    (0, 4, 1, 1)])
def test_auto_ep_divides_the_stage_and_the_experts(experts, world, pp, ep):
    cfg = parse_config(["--num-experts", str(experts), "--pipeline-model-parallel-size",
                        str(pp)])
    assert auto_ep_size(cfg, world) == ep


def test_flags_that_need_the_overlap_do_not_cost_bf16(gpu_rules):
    # --delay-wgrad-compute needs the overlap: the auto values are tried together first
    cfg = resolved(["--delay-wgrad-compute"], world=2, cuda=True)
    assert cfg.train.bf16 is True and cfg.overlap.overlap_moe_expert_parallel_comm is True


def test_resolution_is_idempotent(gpu_rules, monkeypatch):
    one_host_over_nvlink(monkeypatch)
    once = resolved(["--preset", "megatron-cmp", "--mock-data"], world=4, cuda=True)
    assert resolve_config(once, 4, True) == once


def test_torchrun_and_the_launcher_resolve_the_same_config(monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    ranks, on_gpu, train_args = plan_launch(["--train-iters", "3"])
    via_launch, _, _ = checked_config(train_args, ranks, False, ranks, printing=False)
    via_torchrun, _, _ = checked_config(["--preset", "tiny", "--train-iters", "3"], 2, False,
                                        2, printing=False)
    assert (ranks, on_gpu) == (2, False)
    assert via_launch == via_torchrun
    assert via_launch.overlap.overlap_moe_expert_parallel_comm is True


def test_a_capacity_keeps_partial_graphs_over_nvlink(gpu_rules, monkeypatch):
    one_host_over_nvlink(monkeypatch)
    cfg = resolved(["--moe-expert-capacity-factor", "1.0"], world=2, cuda=True)
    assert cfg.cuda_graph.impl == "local" and cfg.moe.moe_dispatch_budget is None


def test_the_path_line_names_what_auto_chose(gpu_rules, monkeypatch):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    cfg = resolved([], world=2, cuda=True)
    line = path_text(cfg, "cuda")
    assert "the tuner's pick of combined_1f1b, combined_1f1b+wgrad" in line
    assert "graphs local (attn moe_router moe_preprocess) | link host memory " \
        "(NCCL_P2P_DISABLE set) |" in line
    assert "| link " not in path_text(resolved([], world=2), "cpu")  # no link asked on CPU
    assert "schedule combined_1f1b | delayed wgrad off" in path_text(cfg, "cpu")
    assert "set by auto defaults: --expert-model-parallel-size, " \
        "--overlap-moe-expert-parallel-comm, --bf16, --cuda-graph-impl;" in line


def test_an_absurd_layer_count_is_refused_not_built():
    # resolving before the check must not build a per-layer list of 2**63 entries
    cfg = resolved(["--num-layers", str(2**63)], world=2)
    assert cfg.parallel.expert_model_parallel_size == 2


def test_asking_for_the_grad_reduce_beside_keeps_the_auto_graphs_partial(gpu_rules, monkeypatch):
    one_host_over_nvlink(monkeypatch)
    cfg = resolved(["--overlap-grad-reduce"], world=2, cuda=True)
    assert cfg.overlap.overlap_grad_reduce is True
    assert cfg.cuda_graph.impl == "local"  # a full-iteration graph would capture the reduces


@pytest.mark.parametrize("kind, medium", [("host_memory", "host memory"),
                                          ("peer_memory", "peer memory")])
def test_on_copy_engines_the_auto_graphs_stop_before_the_dispatch(gpu_rules, monkeypatch, kind,
                                                                   medium):
    """--moe-a2a-transport host_memory or peer_memory: over NVLink, where the auto scope would be one graph
    of the iteration over the budget's fixed blocks, it takes the partial graphs instead (its
    bytes bind, and the budget moves more of them than the dropless dispatch); the path line
    names the transport."""
    one_host_over_nvlink(monkeypatch)
    cfg = resolved(["--moe-a2a-transport", kind], world=2, cuda=True)
    assert cfg.cuda_graph.impl == "local"
    assert cfg.cuda_graph.modules == ("attn", "moe_router", "moe_preprocess")
    assert cfg.moe.moe_dispatch_budget is None
    slot = {"host_memory": 4096, "peer_memory": 65536}[kind]  # each transport's default
    assert f"levers all-to-all over {medium} ({slot} KiB slots)" in path_text(cfg, "cuda")


def test_per_document_attention_on_gpus_gets_the_partial_graphs(gpu_rules, monkeypatch):
    """The graph of the whole iteration is refused with --reset-attention-mask
    (`config.context_rules`); the per-layer graphs, which take the tokens as an input, are
    the auto scope's choice over NVLink too."""
    one_host_over_nvlink(monkeypatch)
    documents = ["--data-path", "docs", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                 "50", "--reset-attention-mask", "--reset-position-ids"]
    cfg = resolved(documents, world=2, cuda=True)
    assert cfg.cuda_graph.impl == "local"
    assert cfg.cuda_graph.modules == ("attn", "moe_router", "moe_preprocess")
