"""Gradient buffers: fp32 `main_grad` per parameter, reduction over the right group, clipping.

Owns `GradBuffers`. Every parameter gets `param.main_grad`, a view into one flat fp32 buffer
for dense parameters and one for expert parameters. The deferrable GEMMs accumulate their
weight grads there directly, and so do the norms' and the embedding's ops
(`model.linear.fused_main_grad`); with --no-gradient-accumulation-fusion every parameter's
autograd `.grad` is folded in by a post-accumulate hook and released (the hook stays for any
parameter whose op returns a grad). Reduction happens once per step, after the step's last
contribution to each grad, inside each pipeline stage (DP = the ranks of the stage; the world
without pipeline parallelism):
  dense:  sum over the stage's data-parallel group, divided by DP;
  expert: sum over the expert-data-parallel group, divided by DP (each EP rank's expert grad
          already sums the contributions of its whole EP group).
It goes bucket by bucket (`bucket_layout`): per layer, its expert grads and its dense grads;
the head's, the final norm's and the embedding's; each a view of its flat buffer, in the order
the backward completes them (the head first, then the last layer). With --overlap-grad-reduce the
executor reduces each bucket beside the rest of the backward (`schedule.grad_reduce` says
when; `reduce_bucket`), otherwise `reduce` does them all after the plan, in the same order:
the same tensors in the same order over the same groups, so the same bits either way (a
collective's sum order depends on how a buffer is split, so the split never depends on the
mode). `reduce` reduces what the executor has not, so it may always be called after a step's
forward-backward.
The global grad norm counts replicated parameters once, sums the expert shards over EP and the
stages over PP (no parameter is tied across stages). It adds per-parameter squared L2 norms in
the whole model's parameter order, so it has the same bits at any pipeline size. The
per-parameter squares are, on a GPU, one launch per grad buffer
(`kernels.square_sums_triton`: each grad read once, in chunks counted from its parameter's
start); elsewhere one `_foreach_norm`, squared.
"""

from __future__ import annotations

import math
import re
from typing import Optional

import torch
from torch import nn

from epoverlap.config import RunConfig
from epoverlap.parallel.groups import ParallelGroups
from epoverlap.parallel.watch import host_list
from epoverlap.schedule.grad_reduce import ReduceBucket


def expert_grad_placement(cfg: RunConfig) -> dict:
    """Where the flags allow the experts' fused weight grads to go (`WeightGradQueue`): paired
    over microbatches 2k and 2k+1 and the run's first overwriting the main grad, whenever the
    weight grads are fused into it and no per-layer CUDA graph splits a run (with
    --cuda-graph-impl local a graph's capture is not one run of the plan). Neither changes a
    bit. Whether the pairing's held rows fit is decided by `setup.memory.place_expert_grads`."""
    on = not cfg.train.no_gradient_accumulation_fusion and cfg.cuda_graph.impl != "local"
    return {"first_write": on, "pair_microbatches": on}


def _fold_into_main_grad(param: torch.Tensor) -> None:
    if param.grad is None:  # a deferrable GEMM already wrote main_grad and returned no grad
        return
    param.main_grad.add_(param.grad)
    param.grad = None


def is_expert(param: torch.Tensor) -> bool:
    return getattr(param, "is_expert", False)


class GradBuffers:
    """Flat fp32 grad buffers for a model's dense and expert parameters."""

    def __init__(self, model: nn.Module, groups: ParallelGroups,
                 fuse_grad_accumulation: bool = True):
        self.groups = groups
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        self.params = params
        self.dense = [p for p in params if not is_expert(p)]
        self.expert = [p for p in params if is_expert(p)]
        device = params[0].device
        self.dense_flat = self._attach(self.dense, device)
        self.expert_flat = self._attach(self.expert, device)
        layout = bucket_layout(named)
        self.buckets = [bucket for bucket, _, _ in layout]  # `BucketReducer.buckets`
        self._views = [((self.expert_flat if expert else self.dense_flat)[start:end], expert)
                       for _, expert, (start, end) in layout]  # views, no copies
        self._reduced = [False] * len(self.buckets)
        for p in params:  # the dense GEMMs add their weight grads into main_grad themselves
            p.fuse_grad_accumulation = fuse_grad_accumulation
        self._hooks = [p.register_post_accumulate_grad_hook(_fold_into_main_grad)
                       for p in params]
        self._square_sums = _square_sums(params, device)
        slots, self._norm_size = _whole_model_slots([n for n, _ in named], groups)
        # made once: where each parameter's square goes, and which are expert shards
        self._norm_slots = torch.tensor(slots, device=device)
        self._is_expert = torch.tensor([is_expert(p) for p in params], device=device)

    @staticmethod
    def _attach(params: list, device) -> torch.Tensor:
        flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        offset = 0
        for p in params:
            p.main_grad = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        return flat

    def zero(self, experts: bool = True) -> None:
        """Zero the grads before a step; `experts` False leaves the expert grads, which the
        step's first weight grads overwrite (`schedule.wgrad`, `first_write`)."""
        self.dense_flat.zero_()
        if experts:
            self.expert_flat.zero_()
        self._reduced = [False] * len(self.buckets)

    def zero_unwritten(self, written: set) -> None:
        """Zero each expert grad the step left unzeroed and no weight grad wrote (`written`:
        the ids of those written): no contribution is a zero grad."""
        for p in self.expert:
            if id(p) not in written:
                p.main_grad.zero_()

    def reduce(self) -> None:
        """Average over data-parallel replicas (see the module docstring for the scaling) every
        bucket the executor has not reduced since `zero`, in the buckets' order."""
        for index, done in enumerate(self._reduced):
            if not done:
                self.reduce_bucket(index)

    def reduce_bucket(self, index: int) -> None:
        """Average bucket `index` over its data-parallel replicas (on the current stream)."""
        self._reduced[index] = True
        g = self.groups
        if g.dp_size == 1:
            return
        view, expert = self._views[index]
        if not expert:
            g.dp.all_reduce(view)
        elif g.edp_size > 1:
            g.edp.all_reduce(view)
        view.div_(g.dp_size)

    def norm_squared(self) -> torch.Tensor:
        """The square of the whole (global) gradient's L2 norm, on the device (0-d float64, no
        host read: the step reads it with its other figures, `telemetry.step_stats`).
        Collective over the EP and PP groups."""
        g = self.groups
        squares = self._squares()
        dense_sq = torch.zeros(self._norm_size, device=squares.device)
        expert_sq = torch.zeros_like(dense_sq)
        dense_sq[self._norm_slots] = torch.where(self._is_expert, 0.0, squares)
        expert_sq[self._norm_slots] = torch.where(self._is_expert, squares, 0.0)
        if g.ep_size > 1:
            g.ep.all_reduce(expert_sq)
        whole_sq = dense_sq + expert_sq  # every slot is one of the two, the other is 0
        if g.pp_size > 1:
            g.pp.all_reduce(whole_sq)  # one stage per slot, the others 0
        return whole_sq.double().sum()

    def global_norm(self) -> float:
        """L2 norm of the whole (global) gradient (`norm_squared`, read)."""
        return math.sqrt(host_list(self.norm_squared()))

    def _squares(self) -> torch.Tensor:
        """[parameters] fp32: each grad's sum of squares, in `self.params`' order."""
        if self._square_sums is None:
            return torch.stack(torch._foreach_norm([p.main_grad for p in self.params],
                                                   2)).square()
        squares = torch.empty(len(self.params), dtype=torch.float32,
                              device=self.dense_flat.device)
        for flat, (sums, where) in zip((self.dense_flat, self.expert_flat), self._square_sums):
            if len(where):
                squares[where] = sums(flat)
        return squares

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def clip_factor(norm: float, max_norm: float) -> float:
    """The factor that brings a grad norm to at most max_norm: 1.0 when it is below or max_norm
    is 0. The grads are left as they are: the optimizer applies it."""
    if max_norm > 0 and norm > max_norm:
        return max_norm / (norm + 1e-6)
    return 1.0


def _square_sums(params: list, device: torch.device) -> Optional[list]:
    """On CUDA, per grad buffer (dense, expert) its `SquareSums` over its parameters' spans
    (where `GradBuffers._attach` put each `main_grad` in its buffer) and their places in
    `params`; None elsewhere (`_foreach_norm`)."""
    if device.type != "cuda":
        return None
    from epoverlap.kernels.square_sums_triton import SquareSums
    out = []
    for expert in (False, True):
        where = [i for i, p in enumerate(params) if is_expert(p) == expert]
        starts = [params[i].main_grad.storage_offset() for i in where]
        spans = [(start, start + params[i].numel()) for start, i in zip(starts, where)]
        out.append((SquareSums(spans, device),
                    torch.tensor(where, dtype=torch.int64, device=device)))
    return out


def bucket_layout(named: list) -> list[tuple[ReduceBucket, bool, tuple[int, int]]]:
    """(bucket, whether it is of the expert buffer, [start, end) in that buffer) of the
    parameters `named` ((name, parameter) in buffer order): each layer's expert grads and its
    dense grads, and each run of parameters outside the layers (named after its first one:
    `head`, `final_norm`, `embedding`), in the order the backward completes them: those the
    `loss` node writes, the layers from the last, those `embed` writes. Empty buckets are left
    out."""
    runs: list[list] = []  # [owner, expert, start, end, name]
    offsets = [0, 0]
    for name, param in named:
        owner, expert = _owner(name), is_expert(param)
        start = offsets[expert]
        offsets[expert] += param.numel()
        same = [run for run in runs if run[:2] == [owner, expert]]
        if same and same[-1][3] == start:
            same[-1][3] = offsets[expert]
            continue
        if same and owner[0] is not None:
            raise ValueError(f"parameter {name}: layer {owner[0]}'s grads are not contiguous "
                             "in the grad buffer")
        runs.append([owner, expert, start, offsets[expert], name.split(".")[0]])
    runs.sort(key=_backward_order)
    return [(ReduceBucket(f"L{owner[0]}" + (".expert" if expert else "") if owner[0] is not None
                          else label, *owner), expert, (start, end))
            for owner, expert, start, end, label in runs if end > start]


def _backward_order(run: list) -> tuple:
    """Where the backward completes a bucket's run: the loss node's first, then the layers from
    the last (expert grads first), then the embedding's; later in the buffer first."""
    (layer, node), expert, start = run[0], run[1], run[2]
    if layer is not None:
        return (1, -layer, not expert, -start)
    return (0 if node == "loss" else 2, 0, False, -start)


def _layer_of(name: str) -> Optional[int]:
    """n for a parameter of layer n (`layers.n.`), else None."""
    match = re.match(r"layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def _owner(name: str) -> tuple[Optional[int], Optional[str]]:
    """(layer, None) for a layer's parameter, else (None, the node that writes its grad): the
    embedding's `embed`, every other parameter outside the layers (the final norm, the head)
    `loss`."""
    layer = _layer_of(name)
    if layer is not None:
        return (layer, None)
    return (None, "embed" if name == "embedding" else "loss")


def _model_order_key(name: str, position: int, stage_start: bool) -> tuple:
    """Where a parameter sits in the whole model: before the layers (the embedding), in layer
    n (`layers.n.`, in its layer's order), or after them (final norm, head)."""
    layer = _layer_of(name)
    if layer is not None:
        return (1, layer, position)
    return (0 if stage_start else 2, 0, position)


def _whole_model_slots(names: list[str], groups: ParallelGroups) -> tuple[list[int], int]:
    """(index of each of this stage's parameters in the whole model's parameter order, number
    of parameters of the whole model). Gathers the stages' names over the PP group."""
    stages = [names]
    if groups.pp_size > 1:
        stages = [None] * groups.pp_size
        groups.pp.all_gather_object(stages, names)
    keyed = []
    for stage, stage_names in enumerate(stages):
        first_layer = next((i for i, n in enumerate(stage_names) if n.startswith("layers.")),
                           len(stage_names))
        keyed += [(_model_order_key(n, i, i < first_layer), stage, i)
                  for i, n in enumerate(stage_names)]
    order = {(stage, i): slot for slot, (_, stage, i) in enumerate(sorted(keyed))}
    mine = groups.pp_rank if groups.pp_size > 1 else 0
    return [order[(mine, i)] for i in range(len(names))], len(keyed)
