"""The link from the hardware (parallel.link): the decision table over every combination of
peer access, NVLink, NCCL_P2P_DISABLE and hosts, the unknowns, and the probe on a faked CUDA
machine and NVML (every local rank finds the same facts; nothing is probed on CPU or across
hosts)."""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch

from epoverlap.parallel import link as link_module
from epoverlap.parallel.link import LinkFacts, decide_link, find_link, probe_facts

# (peer access, NVLink, NCCL_P2P_DISABLE set, hosts) -> the link's kind; fast only for nvlink
TABLE = {
    (True, True, False, 1): "nvlink",
    (True, False, False, 1): "pcie",
    (False, True, False, 1): "host memory",
    (False, False, False, 1): "host memory",
    (True, True, True, 1): "host memory",
    (True, False, True, 1): "host memory",
    (False, True, True, 1): "host memory",
    (False, False, True, 1): "host memory",
    **{(peer, nvlink, p2p_off, 2): "network"
       for peer, nvlink, p2p_off in itertools.product((True, False), repeat=3)},
}


def test_the_table_has_all_16_combinations():
    assert set(TABLE) == set(itertools.product((True, False), (True, False), (True, False),
                                               (1, 2)))


@pytest.mark.parametrize("facts, kind", TABLE.items(), ids=str)
def test_the_decision_table(facts, kind):
    found = decide_link(LinkFacts(*facts, gpus=2))
    assert found.kind == kind
    assert found.fast is (kind == "nvlink")
    assert found.reason and found.text() == f"{kind} ({found.reason})"


@pytest.mark.parametrize("peer, nvlink, kind, fast", [
    (True, None, "peer", True),  # no NVML: decided by peer access alone
    (False, None, "host memory", False),
    (None, True, "nvlink", True),
    (None, False, "pcie", False),
    (None, None, "unknown", True),  # not probed: fast unless the environment says not
])
def test_unknowns(peer, nvlink, kind, fast):
    found = decide_link(LinkFacts(peer, nvlink, p2p_disabled=False, hosts=1, gpus=4))
    assert (found.kind, found.fast) == (kind, fast)
    # the environment and the hosts still decide whatever the hardware facts are
    assert not decide_link(LinkFacts(peer, nvlink, p2p_disabled=True, hosts=1)).fast
    assert decide_link(LinkFacts(peer, nvlink, False, hosts=3)).kind == "network"


def test_the_reasons_say_why():
    assert decide_link(LinkFacts(True, True, False, 1, gpus=8)).reason == \
        "peer access between the 8 local GPUs, NVLink on each, per NVML"
    assert decide_link(LinkFacts(False, None, False, 1)).reason == \
        "no peer access between the 2 local GPUs"
    assert decide_link(LinkFacts(True, True, True, 1)).reason == "NCCL_P2P_DISABLE set"
    assert decide_link(LinkFacts(True, True, False, 2, emulated=True)).reason == \
        "2 emulated hosts"
    one = decide_link(LinkFacts(None, None, False, 1, gpus=1))
    assert (one.kind, one.fast) == ("none", True)
    assert not decide_link(LinkFacts(None, None, True, 1, gpus=1)).fast


class FakeNvml(types.ModuleType):
    """pynvml with `active` NVLinks per GPU UUID; other link indices raise NotSupported."""

    NVML_NVLINK_MAX_LINKS, NVML_FEATURE_ENABLED = 18, 1

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    def __init__(self, active: dict):
        super().__init__("pynvml")
        self.active, self.calls = active, []

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes):
        return uuid.decode()

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link >= len(self.active[handle]):
            raise self.NVMLError_NotSupported()
        return self.active[handle][link]


@pytest.fixture
def machine(monkeypatch):
    """A faked one-host CUDA machine of 4 GPUs seen by every rank (peer access everywhere
    unless `machine.no_peer` names pairs), torchrun's LOCAL_WORLD_SIZE 4, NCCL's P2P on."""
    state = types.SimpleNamespace(no_peer=set(), asked=[])

    def can_access(a, b):
        state.asked.append((a, b))
        return (a, b) not in state.no_peer
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", can_access)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda gpu: types.SimpleNamespace(uuid=f"uuid-{gpu}"))
    for name in ("NCCL_P2P_DISABLE", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    return state


def _nvml(monkeypatch, links_per_gpu: list) -> FakeNvml:
    fake = FakeNvml({f"GPU-uuid-{gpu}": links for gpu, links in enumerate(links_per_gpu)})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_nvlink_on_every_gpu_is_fast(machine, monkeypatch):
    fake = _nvml(monkeypatch, [[0, 1]] * 4)  # link 1 of each GPU active
    assert probe_facts(4) == LinkFacts(True, True, False, 1, gpus=4)
    assert find_link(4).kind == "nvlink" and fake.calls == ["init", "shutdown"] * 2
    assert len(machine.asked) == 2 * 12  # every ordered pair, once per probe


def test_a_pcie_host_without_peer_access_is_slow_without_any_variable(machine, monkeypatch):
    _nvml(monkeypatch, [[]] * 4)  # NVML: no NVLink
    machine.no_peer = {(2, 3)}
    found = find_link(4)
    assert (found.kind, found.fast) == ("host memory", False)
    machine.no_peer = set()
    assert (find_link(4).kind, find_link(4).fast) == ("pcie", False)  # peer access over PCIe


def test_nvlink_missing_on_one_gpu_is_not_nvlink(machine, monkeypatch):
    _nvml(monkeypatch, [[1], [1], [0, 0], [1]])
    assert probe_facts(4).nvlink is False


def test_without_nvml_peer_access_decides(machine, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert probe_facts(4).nvlink is None
    assert find_link(4).kind == "peer" and find_link(4).fast
    machine.no_peer = {(1, 0)}
    assert not find_link(4).fast


def test_an_nvml_failure_is_unknown_not_slow(machine, monkeypatch):
    fake = _nvml(monkeypatch, [[1]] * 4)

    def broken(handle, link):
        raise fake.NVMLError("driver/library version mismatch")
    fake.nvmlDeviceGetNvLinkState = broken
    assert probe_facts(4).nvlink is None and fake.calls == ["init", "shutdown"]


def test_every_local_rank_finds_the_same_facts(machine, monkeypatch):
    _nvml(monkeypatch, [[1]] * 4)
    machine.no_peer = {(3, 0)}  # one direction only: every rank asks about every pair
    found = []
    for rank in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        found.append(probe_facts(4))
    assert found == [LinkFacts(False, True, False, 1, gpus=4)] * 4


@pytest.mark.parametrize("setting", ["cpu", "fewer_gpus_seen", "two_hosts", "emulated", "one"])
def test_nothing_is_probed_where_the_hardware_cannot_decide(machine, monkeypatch, setting):
    monkeypatch.setattr(link_module, "_peer_access", lambda gpus: pytest.fail("probed"))
    monkeypatch.setattr(link_module, "_nvlink", lambda gpus: pytest.fail("probed"))
    world, emulated = 4, 1
    if setting == "cpu":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    elif setting == "fewer_gpus_seen":  # one GPU per rank (CUDA_VISIBLE_DEVICES per rank)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    elif setting == "two_hosts":
        world = 8
    elif setting == "emulated":
        emulated = 2
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        world = 1
    facts = probe_facts(world, emulated)
    assert (facts.peer_access, facts.nvlink) == (None, None)
    expected = {"cpu": ("unknown", True), "fewer_gpus_seen": ("unknown", True),
                "two_hosts": ("network", False), "emulated": ("network", False),
                "one": ("none", True)}[setting]
    assert (decide_link(facts).kind, decide_link(facts).fast) == expected


def test_nccl_p2p_disable_still_counts_as_slow(machine, monkeypatch):
    _nvml(monkeypatch, [[1]] * 4)
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert (find_link(4).kind, find_link(4).fast) == ("host memory", False)
