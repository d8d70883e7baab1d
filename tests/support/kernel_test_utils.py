"""Inputs and comparisons shared by the kernel tests (CPU interpreter and GPU).

Shape legend: T tokens, E experts, H hidden, K top-k, N permuted rows, G expert groups.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Kernels run on the CPU interpreter (tests/conftest.py sets this when there is no CUDA).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def generator(seed: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def distinct_logits(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int,
                    device="cpu") -> torch.Tensor:
    """[T, E] logits with no ties in any row, exact in bf16/fp16 (multiples of 1/32, |x| <= 8).

    Ties would make the routing map depend on tie-breaking; the tie rule is tested separately.
    """
    if num_experts > 512:
        raise ValueError(f"num_experts={num_experts}: at most 512 distinct bf16 grid values")
    gen = generator(seed)
    ranks_TE = torch.argsort(torch.rand(num_tokens, num_experts, generator=gen), dim=1)
    values_TE = (ranks_TE.float() - num_experts / 2) / 32
    return values_TE.to(dtype).to(device)


def grouped_logits(num_tokens: int, num_experts: int, num_groups: int, dtype: torch.dtype,
                   seed: int, device="cpu") -> torch.Tensor:
    """Distinct logits whose groups occupy disjoint value ranges, in a random group order per row.

    So group scores (sums of a group's best) never tie, whatever the score function: the group
    choice is unambiguous and the routing map can be compared bit for bit.
    """
    gen = generator(seed)
    per_group = num_experts // num_groups
    group_rank_TG = torch.argsort(torch.rand(num_tokens, num_groups, generator=gen), dim=1)
    inner_TE = torch.argsort(torch.rand(num_tokens, num_groups, per_group, generator=gen), dim=2)
    rank_TE = (group_rank_TG[:, :, None] * per_group + inner_TE).reshape(num_tokens, num_experts)
    values_TE = (rank_TE.float() - num_experts / 2) / 32
    return values_TE.to(dtype).to(device)


def random_routing_map(num_tokens: int, num_experts: int, topk: int, seed: int, *,
                       num_padding: int = 0, empty_experts: tuple[int, ...] = (),
                       device="cpu") -> torch.Tensor:
    """[T, E] bool: each token picks `topk` distinct experts, never one of `empty_experts`; the
    last `num_padding` tokens route nowhere (all-False rows)."""
    gen = generator(seed)
    scores_TE = torch.rand(num_tokens, num_experts, generator=gen)
    if empty_experts:
        scores_TE[:, list(empty_experts)] = -1.0
    top_TK = torch.topk(scores_TE, topk, dim=1).indices
    routing_map_TE = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map_TE.scatter_(1, top_TK, True)
    if num_padding:
        routing_map_TE[num_tokens - num_padding:] = False
    return routing_map_TE.to(device)


def random_like_rows(num_rows: int, hidden: int, dtype: torch.dtype, seed: int,
                     device="cpu") -> torch.Tensor:
    return torch.randn(num_rows, hidden, generator=generator(seed)).to(dtype).to(device)


def random_probs(routing_map_TE: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, E] probs in (0.1, 1.1) where routed, 0 elsewhere."""
    gen = generator(seed)
    probs_TE = torch.rand(routing_map_TE.shape, generator=gen) + 0.1
    return (probs_TE * routing_map_TE.cpu()).to(dtype).to(routing_map_TE.device)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if not torch.equal(actual, expected):
        diff = (actual.double() - expected.double()).abs()
        raise AssertionError(f"{what}: {int((diff > 0).sum())} of {diff.numel()} elements "
                             f"differ, max {float(diff.max())}")


def assert_same_run(first, second, what: str = "") -> None:
    """Bit equality of two runs' outputs (tensors, or tuples / lists of tensors or None)."""
    if isinstance(first, (tuple, list)):
        for i, (a, b) in enumerate(zip(first, second, strict=True)):
            assert_same_run(a, b, f"{what}[{i}]")
        return
    if first is None:
        assert second is None, what
        return
    assert_bits_equal(first, second, what)


@contextlib.contextmanager
def sync_is_an_error() -> Iterator[None]:
    """CUDA: any host synchronisation inside raises (torch's sync debug mode)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def eager_then_graph_replay(step) -> tuple:
    """`step()` once eagerly with host syncs forbidden, twice on a side stream (warm-up), then
    captured in a CUDA graph and replayed: -> (eager outputs, replayed outputs), lists."""
    with sync_is_an_error():
        eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    return list(eager), list(captured)


def close_tolerance(dtype: torch.dtype, *, interpreted: bool) -> dict:
    """assert_close tolerances for values computed in fp32 and stored in `dtype`.

    fp32: summation-order / exp-implementation / fused multiply-add rounding only. Half types:
    an fp32 value a few ulp off can round to the neighbouring half value, so one half ulp
    (relative 2^-7 for bf16, 2^-10 for fp16). Under the interpreter the fp32->bf16 cast
    truncates (GPU and torch round to nearest even): also one bf16 ulp.
    """
    del interpreted  # same bound: one ulp either way
    if dtype == torch.float32:
        return dict(rtol=2e-6, atol=2e-6)
    if dtype == torch.bfloat16:
        return dict(rtol=2 ** -7, atol=1e-5)
    return dict(rtol=2 ** -10, atol=1e-5)


@contextlib.contextmanager
def forbid_host_reads(allowed: Optional[set] = None) -> Iterator[list]:
    """Make every Python-side read of tensor data raise (CPU stand-in for a CUDA sync check).

    Patches Tensor.item / tolist / __int__ / __float__ / __bool__ / __index__ / nonzero /
    masked_select and torch.nonzero / masked_select / unique / repeat_interleave: what a
    data-dependent shape or a host branch on device data needs. Yields the list of violations.
    """
    names = ["item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero",
             "masked_select", "numpy"]
    torch_names = ["nonzero", "masked_select", "unique", "repeat_interleave", "argwhere"]
    violations: list = []
    saved = []

    def guard(owner, name):
        own = owner.__dict__.get(name)

        def raising(*args, **kwargs):
            violations.append(name)
            raise AssertionError(f"host read of device data: {name}")
        saved.append((owner, name, own))
        setattr(owner, name, raising)

    for name in names:
        if not allowed or name not in allowed:
            guard(torch.Tensor, name)
    for name in torch_names:
        guard(torch, name)
    try:
        yield violations
    finally:
        for owner, name, own in reversed(saved):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
