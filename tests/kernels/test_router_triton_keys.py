"""Triton router top-k: the packed (value, expert) sort keys and the two group-limit paths.

Inputs on small exact grids, so that ties are exact and every implementation computes them
alike: exact ties between experts, -0.0 against +0.0, negative selection values (expert bias),
-inf and NaN logits, padding rows (T not a multiple of BLOCK_T). The routing map must match the
torch reference bit for bit; the [groups, experts per group] fast path of the group limit must
give the same map and probs, bit for bit, as the per-group loop it replaces on other shapes.
"""

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

from epoverlap.kernels import router_topk_triton as rt
from epoverlap.kernels.router_topk import router_topk_torch
from epoverlap.kernels.triton_utils import router_tile

from kernel_test_utils import INTERPRETED, assert_bits_equal, close_tolerance, generator

NUM_TOKENS = 21  # not a multiple of any BLOCK_T: padding rows in the last program
INF = math.inf
# logits grids: few values, many exact ties; sums of grid values are exact
LOGITS_GRID = (-INF, -2.0, -1.0, -0.0, 0.0, 1.0, 2.0)
# sigmoid scores 0, 0.5, 1 exactly (also with a fast exp): sums with the bias below are exact
SIGMOID_GRID = (-INF, -0.0, 0.0, INF)
BIAS_GRID = (-1.0, -0.5, -0.25, 0.0, 0.25)


def _pick(grid, shape, seed) -> torch.Tensor:
    idx = torch.randint(0, len(grid), shape, generator=generator(seed))
    return torch.tensor(grid, dtype=torch.float32)[idx]


def _tied_logits(num_experts, grid, seed, finite_per_group=(1, 1)) -> torch.Tensor:
    """[T, E] logits from `grid`; each of the `finite_per_group[0]` groups of a row holds at
    least `finite_per_group[1]` finite values (the reference's softmax of only -inf is NaN, and
    its group limit masks with -inf: a kept group short of finite values would tie with the
    dropped experts, which the kernel never picks)."""
    logits_TE = _pick(grid, (NUM_TOKENS, num_experts), seed)
    groups, need = finite_per_group
    per_group = num_experts // groups
    rank_TE = torch.argsort(torch.rand(NUM_TOKENS, groups, per_group, generator=generator(seed)),
                            dim=2).reshape(NUM_TOKENS, num_experts)
    finite_TE = _pick([v for v in grid if math.isfinite(v)], logits_TE.shape, seed + 1)
    return torch.where(rank_TE < need, finite_TE, logits_TE)


def _bias(num_experts, seed) -> torch.Tensor:
    return _pick(BIAS_GRID, (num_experts,), seed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view (NaN-safe equality)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _check_against_reference(logits_TE, topk, kwargs, device, what):
    ref_probs, ref_map = router_topk_torch(logits_TE, topk, **kwargs)
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    probs, routing_map = rt.router_topk_triton(logits_TE.to(device), topk, **kwargs)
    assert_bits_equal(routing_map.cpu(), ref_map, f"{what} routing_map")
    torch.testing.assert_close(probs.cpu(), ref_probs,
                               **close_tolerance(logits_TE.dtype, interpreted=INTERPRETED))
    return probs.cpu(), routing_map.cpu()


@pytest.mark.parametrize("variant", ["softmax_pre", "softmax_post", "sigmoid_bias"])
@pytest.mark.parametrize("num_experts,topk", [(10, 3), (16, 5), (33, 8)])
def test_router_exact_ties_and_infinities(triton_device, variant, num_experts, topk):
    kwargs = dict(score_function="sigmoid" if variant == "sigmoid_bias" else "softmax",
                  use_pre_softmax=variant == "softmax_pre")
    if variant == "sigmoid_bias":  # negative selection values: scores in [0, 1] + bias
        kwargs["expert_bias"] = _bias(num_experts, 5)
        logits_TE = _pick(LOGITS_GRID, (NUM_TOKENS, num_experts), 1)
    else:
        logits_TE = _tied_logits(num_experts, LOGITS_GRID, 1)
    _check_against_reference(logits_TE, topk, kwargs, triton_device, variant)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: softmax of +inf is NaN
def test_router_key_order_of_special_values(triton_device):
    """Every k on a row of special values: the choice order is the reference's stable sort
    (-0.0 ties +0.0, denormals ordered, -inf above nothing but never skipped, NaN first)."""
    row = [3.0, -0.0, -INF, 1e-45, -1e-45, 0.0, -3.0, INF, -3.0, 0.0, 1.0, -INF, -1e38, 1e38,
           -0.0, 1e-45, math.nan, 2.0, -2.0, math.nan]
    logits_TE = torch.tensor([row, row[::-1]], dtype=torch.float32)
    for topk in range(1, len(row) + 1):
        _, ref_map = router_topk_torch(logits_TE, topk, score_function="softmax")
        _, out_map = rt.router_topk_triton(logits_TE.to(triton_device), topk,
                                           score_function="softmax")
        assert_bits_equal(out_map.cpu(), ref_map, f"k={topk}")


GROUP_CASES = {
    # name: (E, topk, settings); E a power of two, so the fast path applies
    "sigmoid_bias_g4": (32, 4, dict(score_function="sigmoid", num_groups=4, group_topk=2,
                                    scaling_factor=2.5, bias=True)),
    "sigmoid_bias_dsv3_like": (64, 8, dict(score_function="sigmoid", num_groups=8, group_topk=4,
                                           scaling_factor=2.5, bias=True)),
    "softmax_post_g8": (32, 4, dict(score_function="softmax", num_groups=8, group_topk=4)),
    "softmax_pre_g2": (16, 6, dict(score_function="softmax", use_pre_softmax=True,
                                   num_groups=2, group_topk=2)),
    "one_expert_per_group": (16, 4, dict(score_function="softmax", num_groups=16,
                                         group_topk=4)),
    "one_group": (16, 4, dict(score_function="sigmoid", num_groups=1, group_topk=1, bias=True)),
}


def _group_inputs(case):
    num_experts, topk, settings = GROUP_CASES[case]
    kwargs = dict(settings)
    if kwargs.pop("bias", False):
        kwargs["expert_bias"] = _bias(num_experts, 9)
    grid = SIGMOID_GRID if kwargs["score_function"] == "sigmoid" else LOGITS_GRID
    per_group_k = topk // kwargs["group_topk"]
    logits_TE = _tied_logits(num_experts, grid, 4, (kwargs["num_groups"], per_group_k))
    return logits_TE, topk, kwargs


@pytest.mark.parametrize("case", sorted(GROUP_CASES))
def test_router_group_fast_path_matches_loop(triton_device, monkeypatch, case):
    logits_TE, topk, kwargs = _group_inputs(case)
    num_experts = logits_TE.shape[1]
    assert rt._groups_3d(num_experts, kwargs["num_groups"], router_tile(num_experts)[1])
    fast = _check_against_reference(logits_TE, topk, kwargs, triton_device, f"{case} fast")
    monkeypatch.setattr(rt, "_groups_3d", lambda *args: False)
    loop = _check_against_reference(logits_TE, topk, kwargs, triton_device, f"{case} loop")
    assert_bits_equal(_bits(fast[0]), _bits(loop[0]), f"{case} probs fast vs loop")
    assert_bits_equal(fast[1], loop[1], f"{case} map fast vs loop")


def test_router_group_paths_agree_on_degenerate_rows(triton_device, monkeypatch):
    """Rows of -inf, NaN and exact ties in every group (no reference: its softmax of only -inf
    is NaN): the fast path and the loop still agree bit for bit."""
    num_experts, topk = 32, 4
    logits_TE = _pick(LOGITS_GRID + (math.nan,), (NUM_TOKENS, num_experts), 6)
    logits_TE[0] = -INF
    logits_TE[1] = 0.0
    logits_TE[2, ::3] = math.nan
    kwargs = dict(score_function="softmax", num_groups=4, group_topk=2, scaling_factor=2.0)
    runs = []
    for groups_3d in (True, False):
        monkeypatch.setattr(rt, "_groups_3d", lambda *args, _value=groups_3d: _value)
        runs.append(rt.router_topk_triton(logits_TE.to(triton_device), topk, **kwargs))
    assert_bits_equal(_bits(runs[0][0].cpu()), _bits(runs[1][0].cpu()), "probs fast vs loop")
    assert_bits_equal(runs[0][1].cpu(), runs[1][1].cpu(), "map fast vs loop")
    assert int(runs[0][1][:NUM_TOKENS].sum()) == NUM_TOKENS * topk
