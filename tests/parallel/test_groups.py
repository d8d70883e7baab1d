"""Process-group layout (pure CPU): our rank -> (pp, cp, dp, ep) mapping and every group list
against megatron-core 0.16.1's own `RankGenerator` (order tp-cp-ep-dp-pp), for several sizes."""

from __future__ import annotations

import warnings

import pytest

from epoverlap.parallel.groups import RankLayout

SIZES = [(2, 2, 1, 1), (4, 2, 2, 1), (8, 2, 2, 1), (8, 4, 1, 1), (8, 1, 8, 1), (12, 3, 2, 1),
         (16, 2, 4, 1), (16, 4, 2, 1), (24, 2, 3, 1),
         (2, 1, 1, 2), (4, 1, 2, 2), (4, 1, 4, 2), (8, 1, 2, 4), (8, 2, 2, 2), (16, 2, 8, 2),
         (16, 2, 2, 4), (24, 2, 4, 3)]  # (world, PP, EP, CP)


@pytest.fixture(scope="module")
def rank_generator():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its optional-dependency warnings at import
            from megatron.core.parallel_state import RankGenerator
    except ImportError as error:
        pytest.skip(f"megatron-core is not installed (pip install -e '.[peer]'): {error}")
    return RankGenerator


@pytest.mark.parametrize("world, pp, ep, cp", SIZES)
def test_groups_equal_megatron_core_rank_generator(rank_generator, world, pp, ep, cp):
    """The dense generator (ep=1, cp, dp=world/(PP x CP)) gives the pipeline, context-parallel,
    data-parallel and data-parallel-with-CP groups, the expert one (ep, cp=1, dp=EDP) the expert
    and expert-data-parallel groups; lists in its order."""
    ours = RankLayout(world, pp, ep, cp)
    order = "tp-cp-ep-dp-pp"
    dense = rank_generator(tp=1, ep=1, dp=ours.dp_size, pp=pp, cp=cp, order=order)
    expert = rank_generator(tp=1, ep=ep, dp=ours.edp_size, pp=pp, cp=1, order=order)
    assert ours.pp_groups() == dense.get_ranks("pp") == expert.get_ranks("pp")
    assert ours.dp_cp_groups() == dense.get_ranks("dp-cp")
    assert ours.dp_groups() == dense.get_ranks("dp")
    assert ours.cp_groups() == dense.get_ranks("cp")
    assert ours.ep_groups() == expert.get_ranks("ep")
    assert ours.edp_groups() == expert.get_ranks("dp")


@pytest.mark.parametrize("world, pp, ep, cp", SIZES)
def test_each_rank_sits_where_its_groups_say(world, pp, ep, cp):
    layout = RankLayout(world, pp, ep, cp)
    for rank in range(world):
        pp_rank, dp_rank, ep_rank = layout.pp_rank(rank), layout.dp_rank(rank), \
            layout.ep_rank(rank)
        cp_rank, place = layout.cp_rank(rank), layout.stage_rank(rank)
        assert rank == cp_rank + cp * dp_rank + layout.stage_size * pp_rank
        assert rank == ep_rank + ep * layout.edp_rank(rank) + layout.stage_size * pp_rank
        assert layout.pp_groups()[place][pp_rank] == rank
        assert rank in layout.dp_cp_groups()[pp_rank]
        assert layout.dp_groups()[pp_rank * cp + cp_rank][dp_rank] == rank
        assert layout.cp_groups()[rank // cp][cp_rank] == rank
        assert layout.ep_groups()[rank // ep][ep_rank] == rank
        assert layout.edp_groups()[pp_rank * ep + ep_rank][layout.edp_rank(rank)] == rank


def test_without_pipeline_the_layout_is_the_one_before_it():
    layout = RankLayout(4, 1, 2)
    assert layout.ep_groups() == [[0, 1], [2, 3]]
    assert layout.edp_groups() == [[0, 2], [1, 3]]
    assert layout.dp_cp_groups() == [[0, 1, 2, 3]]


def test_the_expert_groups_span_context_parallel_ranks_as_megatron_cores():
    """CP 2 x DP 2 with EP 2: an EP group is one CP group's two ranks (the same sequence's two
    halves route to each other's experts); the EDP group spans CP x DP / EP ranks."""
    layout = RankLayout(4, 1, 2, 2)
    assert layout.cp_groups() == layout.ep_groups() == [[0, 1], [2, 3]]
    assert layout.dp_groups() == layout.edp_groups() == [[0, 2], [1, 3]]
    assert layout.edp_size == 2 and layout.dp_size == 2
