"""bench_peer's torchtitan side: torchtitan 0.3.0's own MoE decoder, parallelized and trained
the way its Trainer does it, on the batches bench_peer feeds every system.

Owns the translation of our config into torchtitan's model config, torchtitan's build sequence
(parallel dims, sharding configs, meta build, `parallelize_qwen3`, init, optimizer, loss) and its
training step. bench_peer imports this module only when `--systems` names torchtitan; this
module imports torchtitan only inside its functions (torchtitan is the optional `peer` extra).

The model: torchtitan's `Qwen3Model` / `Qwen3TransformerBlock` (its common `Decoder`) built from
its own config helpers (`make_gqa_config`, `make_moe_config`, ...) at our shape: the same
layers, hidden size, query heads and key/value groups, head dim, rotary base, RMSNorm epsilon,
experts, top-k, expert FFN, dense FFN, shared expert, vocabulary and sequence; no QK norm (ours
has none), untied embeddings (as ours), no router bias and no expert-bias load balancing
(`load_balance_coeff=None`); balanced routing through the router's own
`_debug_force_load_balance` (round-robin, what torchtitan's `--debug.moe_force_load_balance`
sets). Attention is torchtitan's `ScaledDotProductAttention` (causal SDPA, as ours): its
language-model registry offers only flex and varlen, whose document masks our mock batches do
not need.

Modes (EP = the world, FSDP over the world for the dense weights, bf16 parameters with fp32
gradient reduction: torchtitan's defaults at EP = world):
  a2a             its all-to-all dispatcher, eager (its Trainer refuses CUDA graphs there)
  a2a_compile     the same with torch.compile per transformer block (its `apply_compile`)
  masync          its symmetric-memory `minimal_async_ep` dispatcher, with the full activation
                  checkpointing it requires in eager training and the CUDA graph of the
                  forward-backward its Trainer takes by default (`wrap_with_cuda_graph`)
  masync_compile  the same with torch.compile per transformer block

`Decoder.Config.update_from_config` imports torchtitan's Trainer (and through it torchdata,
datasets and the rest of its data stack) only to check its argument's type; the steps it takes
for a non-Trainer config are taken here by name instead (`prepare_model_config`).
"""

from __future__ import annotations

import importlib.util
import tempfile
import types
from functools import partial
from typing import Optional

import torch

# mode -> (torchtitan's comm_backend, torch.compile)
MODES = {"a2a": ("standard", False), "a2a_compile": ("standard", True),
         "masync": ("minimal_async_ep", False), "masync_compile": ("minimal_async_ep", True)}
# torchtitan's DTensor path for the model-parallel axes and plain FSDP over the data-parallel
# ones; its default `spmd_types` hands FSDP typed plain tensors, which torch 2.13's fully_shard
# refuses ("all parameters must be DTensors on the full SPMD mesh")
SPMD_BACKEND = "partial_dtensor"
INSTALL_HINT = ("bench_peer: torchtitan is not installed: pip install -e '.[peer]' "
                "(torchtitan==0.3.0, Python >= 3.11), or leave torchtitan out of --systems")
CAVEATS = (
    "torchtitan 0.3.0: its Qwen3 decoder class at our shape without QK norm, causal SDPA "
    "attention, its FSDP (bf16 parameters, fp32 reduction) over the EP ranks for the dense "
    "weights, gradients reduced every microbatch as its Trainer does; masync modes add the "
    "full activation recompute minimal_async_ep requires and its CUDA graph of the "
    "forward-backward.",)


def torchtitan_installed() -> bool:
    try:
        return importlib.util.find_spec("torchtitan.models.common") is not None
    except ImportError:  # no `torchtitan` package at all
        return False


# ---------------------------------------------------------------------------- model config
def _normal(std: float) -> dict:
    return {"weight": partial(torch.nn.init.normal_, std=std)}


def _norm(dim: int, eps: float):
    from torchtitan.models.common.nn_modules import RMSNorm
    return RMSNorm.Config(normalized_shape=dim, eps=eps,
                          param_init={"weight": torch.nn.init.ones_})


def _attention(cfg):
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_gqa_config
    m = cfg.model
    return make_gqa_config(
        dim=m.hidden_size, n_heads=m.num_attention_heads, n_kv_heads=m.kv_heads,
        head_dim=m.head_dim, wqkv_param_init=_normal(m.init_method_std),
        wo_param_init=_normal(m.init_method_std),
        inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=True,
        rope=CosSinRoPE.Config(dim=m.head_dim, max_seq_len=m.seq_length,
                               theta=float(m.rotary_base)))


def _ffn(cfg, hidden: int):
    from torchtitan.models.common.config_utils import make_ffn_config
    init = _normal(cfg.model.init_method_std)
    return make_ffn_config(dim=cfg.model.hidden_size, hidden_dim=hidden, w1_param_init=init,
                           w2w3_param_init=init)


def _moe(cfg, comm_backend: str):
    from torchtitan.models.common.config_utils import (make_moe_config,
                                                       make_routed_experts_config,
                                                       make_router_config)
    m, moe = cfg.model, cfg.moe
    init = _normal(m.init_method_std)
    router = make_router_config(
        dim=m.hidden_size, num_experts=moe.num_experts, gate_param_init=init,
        top_k=moe.moe_router_topk, score_func=moe.moe_router_score_function,
        # Megatron's (and our) post-softmax top-k = torchtitan's softmax + renormalized top-k
        route_norm=not moe.moe_router_pre_softmax,
        route_scale=moe.moe_router_topk_scaling_factor or 1.0,
        num_expert_groups=moe.moe_router_num_groups or None,
        num_limited_groups=moe.moe_router_group_topk or None)
    router._debug_force_load_balance = moe.moe_router_force_load_balancing
    experts = make_routed_experts_config(
        dim=m.hidden_size, hidden_dim=moe.moe_ffn_hidden_size or m.ffn_hidden_size,
        num_experts=moe.num_experts, top_k=moe.moe_router_topk,
        param_init={name: init["weight"] for name in ("w1_EFD", "w2_EDF", "w3_EFD")},
        comm_backend=comm_backend)
    shared = moe.moe_shared_expert_intermediate_size
    return make_moe_config(num_experts=moe.num_experts, router=router, routed_experts=experts,
                           shared_experts=_ffn(cfg, shared) if shared else None,
                           load_balance_coeff=None)


def model_config(cfg, comm_backend: str = "standard"):
    """torchtitan's `Qwen3Model.Config` of our config (see the module docstring)."""
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
    m = cfg.model
    eps, init = m.norm_epsilon, _normal(m.init_method_std)
    layers = [Qwen3TransformerBlock.Config(
        attention_norm=_norm(m.hidden_size, eps), ffn_norm=_norm(m.hidden_size, eps),
        attention=_attention(cfg), moe=_moe(cfg, comm_backend) if is_moe else None,
        feed_forward=None if is_moe else _ffn(cfg, m.ffn_hidden_size))
        for is_moe in cfg.moe_layer_pattern()]
    return Qwen3Model.Config(
        vocab_size=m.vocab_size, dim=m.hidden_size, norm=_norm(m.hidden_size, eps),
        tok_embeddings=Embedding.Config(num_embeddings=m.vocab_size,
                                        embedding_dim=m.hidden_size, param_init=init),
        lm_head=Linear.Config(in_features=m.hidden_size, out_features=m.vocab_size,
                              param_init=init),
        layers=layers, enable_weight_tying=False)


def job_config(cfg, world: int, mode: str):
    """The parts of torchtitan's `Trainer.Config` its model and parallelize functions read."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    comm_backend, compiled = MODES[mode]
    masync = comm_backend == "minimal_async_ep"
    t = cfg.train
    return types.SimpleNamespace(
        parallelism=ParallelismConfig(expert_parallel_degree=world,
                                      data_parallel_shard_degree=-1,
                                      spmd_backend=SPMD_BACKEND),
        training=TrainingConfig(local_batch_size=t.micro_batch_size,
                                seq_len=cfg.model.seq_length, max_norm=t.clip_grad or 1e30,
                                steps=t.train_iters, disable_cuda_graphs=not masync),
        compile=CompileConfig(enable=compiled, components=["model", "loss"]),
        activation_checkpoint=FullAC.Config() if masync else None)


def prepare_model_config(model_cfg, job) -> None:
    """What `Qwen3Model.Config.update_from_config` does for this job: fill the EP dispatchers'
    sizes (torchtitan's `update_ep_token_dispatcher_config`, which also runs
    `maybe_update_minimal_async_ep_config`) and set the sharding configs. Raises ValueError
    where torchtitan refuses the combination."""
    from torchtitan.models.common.token_dispatcher import update_ep_token_dispatcher_config
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
    update_ep_token_dispatcher_config(model_cfg, job)
    parallelism = job.parallelism
    set_qwen3_sharding_config(model_cfg, enable_sp=parallelism.enable_sequence_parallel,
                              enable_ep=parallelism.expert_parallel_degree > 1)


def torch_problem() -> Optional[str]:
    """What this torch lacks of the FSDP API torchtitan 0.3.0's parallelize path imports (each
    torchtitan release pins a torch nightly; 2.13.0 has both, 2.11.0 neither), or None.

    This is the one place the torch version matters. On torch 2.11 it is more than two names:
    `torchtitan.models.qwen3` (its package imports `parallelize`, then `distributed.fsdp`)
    fails to import, and at EP > 1 its `apply_fsdp_to_decoder` gives the routed experts their
    own FSDP mesh through `ShardPlacementResult(placement, mesh_info)`, a per-parameter mesh
    2.11's `fully_shard` does not have. The releases before 0.3.0 (0.2.x) import on 2.11 but
    are no way round: their MoE is CUDA-only (`torch.histc` on int64 routing indices, a Triton
    permute kernel in the EP dispatch), their Qwen3 has no dense/MoE layer pattern nor a shared
    expert of its own size, they have no `minimal_async_ep`, and their config API is another."""
    import torch.distributed.fsdp as fsdp
    from torch.distributed.fsdp._fully_shard import _fsdp_common
    missing = [name for module, name in ((fsdp, "DataParallelMeshDims"),
                                         (_fsdp_common, "ShardPlacementResult"))
               if not hasattr(module, name)]
    if not missing:
        return None
    return (f"torchtitan refuses it: torch {torch.__version__} lacks {', '.join(missing)} "
            "of FSDP, which torchtitan 0.3.0 imports and its EP FSDP (a per-parameter mesh) "
            "needs (it pins a newer torch)")


def _require_its_torch() -> None:
    """Raise where torch lacks torchtitan's FSDP API, before a half-done import of its Qwen3
    package (whose model submodule would stay importable while the package is not)."""
    problem = torch_problem()
    if problem is not None:
        raise RuntimeError(problem)


def refusal(cfg, world: int, mode: str, cuda: bool) -> Optional[str]:
    """Why torchtitan cannot run `mode` at this shape and world size, or None."""
    problem = torch_problem()
    if problem is not None:
        return problem
    if not cuda:  # its device meshes take "cuda" where no accelerator is found
        return "torchtitan refuses it: its device meshes are CUDA only"
    if cfg.moe.num_experts % world:
        return (f"torchtitan refuses it: {cfg.moe.num_experts} experts do not split over "
                f"EP = {world}")
    try:
        prepare_model_config(model_config(cfg, MODES[mode][0]), job_config(cfg, world, mode))
    except (ValueError, NotImplementedError) as error:
        return f"torchtitan refuses it: {error}"
    return None


def count_parameters(model) -> int:
    """Every element of the model's parameters (experts over all ranks on an unsharded model)."""
    return sum(p.numel() for p in model.parameters())


def build_local(cfg, device: str = "cpu"):
    """The model of `cfg` on one process (EP 1, local dispatch), initialized, fp32: for the
    parameter count and a forward on CPU."""
    _require_its_torch()
    from torchtitan.tools import utils
    model_cfg = model_config(cfg)
    with torch.device("meta"), utils.set_default_dtype(torch.float32):
        model = model_cfg.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


# ---------------------------------------------------------------------------- training
class Session:
    """One mode's model, optimizer and loss, built as torchtitan's Trainer builds them, and its
    training step (`step`)."""

    def __init__(self, cfg, world: int, mode: str, device: torch.device):
        _require_its_torch()
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.distributed.parallel_dims import ParallelDims
        self.cfg, self.mode, self.device = cfg, mode, device
        self.job = job_config(cfg, world, mode)
        dist_utils.set_spmd_backend(self.job.parallelism.spmd_backend)
        self.dims = ParallelDims.from_config(self.job.parallelism, world)
        self._seed()
        self.model = self._model()
        self.loss_fn = self._loss()
        self.optimizers = self._optimizers()
        self.context = dist_utils.get_spmd_context(parallel_dims=self.dims)
        self.fwd_bwd = self._forward_backward
        self.graphed = not self.job.training.disable_cuda_graphs
        if self.graphed:  # the Trainer's default where the dispatcher allows it
            from torchtitan.distributed.cudagraph import wrap_with_cuda_graph
            self.fwd_bwd = wrap_with_cuda_graph(self.fwd_bwd)

    def _seed(self) -> None:
        from torchtitan.config.configs import DebugConfig
        from torchtitan.distributed import utils as dist_utils
        torch.manual_seed(self.cfg.train.seed)
        dist_utils.set_determinism(self.dims, self.device, DebugConfig(seed=self.cfg.train.seed),
                                   distinct_seed_mesh_dims=["pp"])

    def _model(self):
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3
        from torchtitan.tools import utils
        comm_backend = MODES[self.mode][0]
        model_cfg = model_config(self.cfg, comm_backend)
        prepare_model_config(model_cfg, self.job)
        with torch.device("meta"), utils.set_default_dtype(torch.float32):
            model = model_cfg.build()
        with tempfile.TemporaryDirectory() as dump:
            model = parallelize_qwen3(
                model, parallel_dims=self.dims, training=self.job.training,
                parallelism=self.job.parallelism, compile_config=self.job.compile,
                ac_config=self.job.activation_checkpoint, dump_folder=dump)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        if self.device.type == "cpu":  # gloo has no PREMUL_SUM: its divide factor is 1, a sum
            for module in model.modules():
                if hasattr(module, "set_force_sum_reduction_for_comms"):
                    module.set_force_sum_reduction_for_comms(True)
        return model

    def _loss(self):
        from torchtitan.components.loss import CrossEntropyLoss
        return CrossEntropyLoss.Config(global_vocab_size=self.cfg.model.vocab_size).build(
            compile_config=self.job.compile)

    def _optimizers(self):
        from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
        t = self.cfg.train
        group = ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={
            "lr": t.lr, "betas": (t.adam_beta1, t.adam_beta2), "eps": t.adam_eps,
            "weight_decay": t.weight_decay})
        return OptimizersContainer.Config(param_groups=[group]).build(model_parts=[self.model])

    def _forward_backward(self, inputs, labels, global_valid_tokens, extra_kwargs):
        """The Trainer's `_forward_backward_body`: local loss sum / global tokens, backward."""
        import spmd_types as spmd
        with self.context():
            pred = self.model(inputs, **extra_kwargs)
            loss, _ = self.loss_fn(pred, labels, global_valid_tokens)
            del pred
            with spmd.no_typecheck():
                loss.backward()
        return loss

    def step(self, batches: list, lr: float) -> float:
        """One training step as the Trainer's `train_step` runs it (microbatches as its gradient
        accumulation steps) at learning rate `lr` -> the mean loss over tokens and ranks."""
        from torchtitan.distributed import utils as dist_utils
        self.optimizers.zero_grad(set_to_none=not self.graphed)
        local = torch.tensor(sum(labels.numel() for _, labels in batches), dtype=torch.int64)
        global_tokens = dist_utils.dist_sum_tensor(local.to(self.device),
                                                   self.dims.get_mesh("batch"))
        total = torch.zeros((), device=self.device)
        for tokens, labels in batches:  # (its input annotation is for spmd_types only)
            total += self.fwd_bwd(tokens.to(self.device), labels.to(self.device), global_tokens,
                                  {}).detach()
        dist_utils.clip_grad_norm_([p for p in self.model.parameters()],
                                   self.job.training.max_norm, foreach=True, pp_mesh=None,
                                   ep_enabled=self.dims.ep_enabled)
        for optimizer in self.optimizers.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        self.optimizers.step()
        torch.distributed.all_reduce(total)
        return float(total)

    def close(self) -> None:
        if self.graphed:
            from torchtitan.distributed.cudagraph import cudagraph_teardown
            cudagraph_teardown()
        self.model = self.optimizers = self.fwd_bwd = None

