"""The simulator's K/V exchange under context parallelism (epoverlap/simulator/context_costs.py
and its place in scenario.py), pure CPU: the bytes worked out by hand from the shape, the
time scaling as those bytes and calls say at CP 2, 4 and 8, the all-gather's transfers held
by the comm lane (a `kv_gather` action per layer, microbatch and phase, lasting the predicted
time), the ring's inside the `attn` action on the compute lane, and a rank's tokens S / CP."""

from __future__ import annotations

import pytest

from epoverlap.config import parse_config
from epoverlap.model.nodes import COMM
from epoverlap.schedule.plan import Action
from epoverlap.simulator import context_costs as cc
from epoverlap.simulator.costs import LinkModel

TINY = ["--preset", "tiny"]  # B 4, S 128, G 2 key/value heads, D 128 / 4 = 32, fp32
# S 1024 so that every CP size up to 8 holds 2 chunks of 64 tokens
LONG = TINY + ["--seq-length", "1024"]
NO_LATENCY = LinkModel("test", bandwidth_gbs=100.0, latency_us=0.0)


def _kv(cp: int, comm_type: str = "allgather", extra=()) -> cc.KvShape:
    cfg = parse_config(LONG + ["--context-parallel-size", str(cp), "--cp-comm-type",
                               comm_type, *extra])
    return cc.KvShape.from_config(cfg)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_exchange_bytes_are_the_other_ranks_share_of_k_and_v(cp):
    kv = _kv(cp)
    local = 2 * 4 * 2 * (1024 // cp) * 32 * 4  # K and V x B x G x s x D x fp32
    assert kv.kv_bytes == local
    gathered = cp * local  # every rank's [K, V]
    sent, calls = cc.exchange_volume(kv, "allgather")
    assert (sent, calls) == ((cp - 1) * gathered // cp, 1)  # (CP - 1) / CP of the gathered
    assert cc.exchange_volume(kv, "p2p") == ((cp - 1) * local, cp - 1)  # CP - 1 ring steps
    bf16 = cc.KvShape.from_config(parse_config(LONG + ["--context-parallel-size", str(cp),
                                                       "--bf16"]))
    assert bf16.kv_bytes * 2 == local


def test_the_time_scales_as_the_bytes_and_the_calls_say():
    """At a fixed sequence, a rank's K/V is 1 / CP of it and the exchange sends (CP - 1) of
    them: (CP - 1) / CP of the sequence's K/V, so CP 4 sends 3/2 of CP 2's bytes and CP 8
    7/4; with latency the ring pays it CP - 1 times, the all-gather once."""
    wire = {cp: cc.kv_exchange_us(NO_LATENCY, _kv(cp), "allgather") for cp in (2, 4, 8)}
    assert wire[4] / wire[2] == pytest.approx(1.5)
    assert wire[8] / wire[2] == pytest.approx(1.75)
    whole_kv = 2 * 4 * 2 * 1024 * 32 * 4
    assert wire[2] == pytest.approx(whole_kv / 2 / (100.0 * 1e3))  # bytes / (GB/s) in us
    for cp in (2, 4, 8):
        ring = cc.kv_exchange_us(NO_LATENCY, _kv(cp, "p2p"), "p2p")
        assert ring == pytest.approx(wire[cp])  # the same bytes, in CP - 1 steps
        slow = LinkModel("test", bandwidth_gbs=100.0, latency_us=10.0)
        assert cc.kv_exchange_us(slow, _kv(cp, "p2p"), "p2p") == pytest.approx(
            wire[cp] + 10.0 * (cp - 1))
        assert cc.kv_exchange_us(slow, _kv(cp), "allgather") == pytest.approx(wire[cp] + 10.0)


def test_a_cp_group_inside_a_node_goes_over_nvlink():
    ib = LinkModel("ib", bandwidth_gbs=40.0, latency_us=0.0, gpus_per_node=4, nvlink_gbs=400.0)
    assert cc.cp_bandwidth_gbs(ib, 4) == 400.0 and cc.cp_bandwidth_gbs(ib, 8) == 40.0
    assert cc.kv_exchange_us(ib, _kv(4), "allgather") == pytest.approx(
        cc.kv_exchange_us(NO_LATENCY, _kv(4), "allgather") / 4)


def _scenario(cp: int, comm_type: str, *extra):
    from epoverlap.cli import simulate as sim
    args = sim.parse_args(["--flops", "--link", "nvlink", "--", *LONG, "--expert-model-"
                           "parallel-size", "2", "--context-parallel-size", str(cp),
                           "--cp-comm-type", comm_type, *extra])
    return sim, sim.build_scenario(args)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_comm_lane_holds_each_layers_gather_at_its_predicted_time(cp):
    sim, scenario = _scenario(cp, "allgather")
    assert scenario.shape.tokens == 4 * 1024 // cp  # a rank's S / CP tokens of each sequence
    predicted = cc.kv_exchange_us(sim.sc.LINKS["nvlink"], _kv(cp), "allgather")
    assert predicted > sim.sc.LINKS["nvlink"].latency_us
    assert any(f"K/V exchange, CP {cp}" in line and "kv_gather node, comm lane" in line
               for line in scenario.sources)
    for mode in ("seq", "ovl"):
        result = sim.run_mode(scenario, mode)
        for rank in result.ranks:
            gathers = [s for s in rank.spans if s.action.node == "kv_gather"]
            # F and B of each layer and microbatch: 2 layers x 4 microbatches x 2
            assert len(gathers) == 16
            assert {(s.action.kind, s.action.layer) for s in gathers} == {
                (k, layer) for k in "FB" for layer in (0, 1)}
            assert all(s.lane == COMM for s in gathers)  # serial lanes: one FIFO, comm spans
            assert min(s.end_us - s.start_us for s in gathers) == pytest.approx(predicted)
    comp = sim.run_mode(scenario, "comp")  # the baseline: the gathers as local copies
    local = [s.end_us - s.start_us for s in comp.ranks[0].spans if s.action.node == "kv_gather"]
    assert max(local) < predicted


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_ring_is_charged_to_the_attn_action_on_the_compute_lane(cp):
    """p2p: no gather node; each attn F and B lasts its FLOP time plus the ring's CP - 1
    transfers, which the all-gather's layout puts on the comm lane instead."""
    sim, ring = _scenario(cp, "p2p")
    _, gather = _scenario(cp, "allgather")
    assert not any(kind.name == "kv_gather" for layer in ring.layout for kind in layer)
    predicted = cc.kv_exchange_us(sim.sc.LINKS["nvlink"], _kv(cp, "p2p"), "p2p")
    for kind in ("F", "B"):
        action = Action(kind, 0, "attn", 1)
        alone = gather.compute.for_plan(False)(0, action)
        assert ring.compute.for_plan(False)(0, action) == pytest.approx(alone + predicted)
    spans = sim.run_mode(ring, "ovl").ranks[0].spans
    assert not any(s.lane == COMM and s.action.node not in ("dispatch", "combine")
                   for s in spans)


def test_each_layer_takes_its_own_exchange():
    sim, scenario = _scenario(2, "p2p", "allgather")  # layer 0 the ring, layer 1 the gather
    names = [[kind.name for kind in layer] for layer in scenario.layout]
    assert "kv_gather" not in names[0] and names[1][:3] == ["qkv", "kv_gather", "attn"]
    ring = scenario.compute.for_plan(False)
    assert ring(0, Action("F", 0, "attn", 0)) > ring(0, Action("F", 0, "attn", 1))


def test_cp1_has_no_exchange():
    kv = cc.KvShape.from_config(parse_config(LONG))
    assert kv.comm_type(0) is None
    assert cc.ring_us(NO_LATENCY, kv, Action("F", 0, "attn", 0)) == 0.0


def test_the_prediction_table_is_the_simulators():
    """benchmarks/harness/cp_predictions.py (context_parallel.md's table) at a small shape:
    each row's exchange is context_costs' and its steps are the simulated ones."""
    from benchmarks.harness import cp_predictions
    flags = LONG + ["--num-microbatches", "2"]
    row = cp_predictions.row(flags, 4, "nvlink")
    sim, scenario = _scenario(4, "allgather", "--num-microbatches", "2",
                              "--expert-model-parallel-size", "4")  # EP = CP there
    link = sim.sc.LINKS["nvlink"]
    assert row["allgather_us"] == cc.kv_exchange_us(link, _kv(4), "allgather")
    assert row["ring_us"] == cc.kv_exchange_us(link, _kv(4, "p2p"), "p2p")
    assert row["sent_mib"] == 3 * row["kv_mib"]
    assert row["wgrad_allgather_ms"] == pytest.approx(
        sim.run_mode(scenario, "wgrad").step_us / 1e3)
    assert "| 4 | nvlink |" in cp_predictions.table([row])
