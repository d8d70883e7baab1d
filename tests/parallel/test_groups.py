"""Process-group layout (pure CPU): our rank -> (pp, ep, dp) mapping and every group list
against megatron-core 0.16.1's own `RankGenerator` (order tp-cp-ep-dp-pp), for several sizes."""

from __future__ import annotations

import warnings

import pytest

from epoverlap.parallel.groups import RankLayout

SIZES = [(2, 2, 1), (4, 2, 2), (8, 2, 2), (8, 4, 1), (8, 1, 8), (12, 3, 2), (16, 2, 4),
         (16, 4, 2), (24, 2, 3)]  # (world, PP, EP)


@pytest.fixture(scope="module")
def rank_generator():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its optional-dependency warnings at import
            from megatron.core.parallel_state import RankGenerator
    except ImportError as error:
        pytest.skip(f"megatron-core is not installed (pip install -e '.[peer]'): {error}")
    return RankGenerator


@pytest.mark.parametrize("world, pp, ep", SIZES)
def test_groups_equal_megatron_core_rank_generator(rank_generator, world, pp, ep):
    """The dense generator (ep=1, dp=world/PP) gives the pipeline and data-parallel groups, the
    expert one (ep, dp=EDP) the expert and expert-data-parallel groups; lists in its order."""
    ours = RankLayout(world, pp, ep)
    dense = rank_generator(tp=1, ep=1, dp=ours.dp_size, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    expert = rank_generator(tp=1, ep=ep, dp=ours.edp_size, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    assert ours.pp_groups() == dense.get_ranks("pp") == expert.get_ranks("pp")
    assert ours.dp_groups() == dense.get_ranks("dp")
    assert ours.ep_groups() == expert.get_ranks("ep")
    assert ours.edp_groups() == expert.get_ranks("dp")


@pytest.mark.parametrize("world, pp, ep", SIZES)
def test_each_rank_sits_where_its_groups_say(world, pp, ep):
    layout = RankLayout(world, pp, ep)
    for rank in range(world):
        pp_rank, dp_rank, ep_rank = layout.pp_rank(rank), layout.dp_rank(rank), \
            layout.ep_rank(rank)
        assert rank == ep_rank + ep * layout.edp_rank(rank) + layout.dp_size * pp_rank
        assert layout.pp_groups()[dp_rank][pp_rank] == rank
        assert rank in layout.dp_groups()[pp_rank]
        assert layout.ep_groups()[rank // ep][ep_rank] == rank
        assert layout.edp_groups()[pp_rank * ep + ep_rank][layout.edp_rank(rank)] == rank


def test_without_pipeline_the_layout_is_the_one_before_it():
    layout = RankLayout(4, 1, 2)
    assert layout.ep_groups() == [[0, 1], [2, 3]]
    assert layout.edp_groups() == [[0, 2], [1, 3]]
    assert layout.dp_groups() == [[0, 1, 2, 3]]
