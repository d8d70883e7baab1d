"""Emulated hosts and NCCL's transport report (issue 44): the host identity of each rank, NCCL's
connection lines parsed, a report that flags two hosts talking over anything but the network
transport, NCCL's log left alone when the user set NCCL_DEBUG, the flags' errors. GPU tier (2
GPUs as 2 emulated hosts of 1): the training command's report names NCCL's network transport
between the hosts, and without emulation a transport inside the host."""

from __future__ import annotations

import pytest

from epoverlap.config import parse_config
from epoverlap.config.resolve import validate_config
from epoverlap.errors import ConfigError
from epoverlap.parallel.link import find_link
from epoverlap.parallel.transport import (TransportReport, emulated_host_id, parse_transports,
                                          transport_log_env)

from gloo_workers import TINY
from gpu_runs import needs_gpus, train_cli

NCCL_LOG = """\
host:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
host:1:2 [0] NCCL INFO Channel 02/1 : 0[0] -> 1[1] [send] via NET/Socket/0
host:1:3 [1] NCCL INFO Channel 02/1 : 1[1] -> 0[0] [receive] via NET/Socket/0/Shared
host:1:3 [1] NCCL INFO Connected all rings, use ring PXN 0 GDR 0
host:1:3 [1] NCCL INFO Channel 01/0 : 1[1] -> 2[2] via SHM/direct/direct
"""


def test_connection_lines_parse_into_rank_pairs_and_transports():
    assert parse_transports(NCCL_LOG) == {
        (0, 1): {"P2P/CUMEM/read", "NET/Socket/0"},
        (1, 0): {"NET/Socket/0/Shared"},
        (1, 2): {"SHM/direct/direct"}}


def test_emulated_hosts_are_runs_of_consecutive_local_ranks():
    ids = [emulated_host_id(r, 4, 2, machine="m") for r in range(4)]
    assert ids[0] == ids[1] != ids[2] == ids[3]
    assert ids[0] == "m-emulated-host-0"
    with pytest.raises(ValueError):
        emulated_host_id(0, 3, 2)


def test_the_report_flags_hosts_that_talk_over_anything_but_the_network():
    hosts = ["a", "a", "b", "b"]
    good = TransportReport(hosts, {(0, 1): {"P2P/CUMEM"}, (1, 2): {"NET/Socket/0"},
                                   (2, 1): {"NET/Socket/0"}})
    assert good.problems() == []
    assert "transport: rank 1 -> 2 (between hosts): NET/Socket/0" in good.lines()
    bad = TransportReport(hosts, {(1, 2): {"NET/Socket/0", "SHM/direct/direct"}})
    assert bad.problems() == ["rank 1 -> 2: NET/Socket/0, SHM/direct/direct"]
    silent = TransportReport(hosts, {(0, 1): {"P2P/CUMEM"}})
    assert silent.problems() == ["no connection between two hosts was named"]
    assert TransportReport(["a", "a"], {(0, 1): {"P2P/CUMEM"}}).problems() == []


def test_nccls_log_is_left_alone_when_the_user_set_nccl_debug(monkeypatch, tmp_path):
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    env = transport_log_env(str(tmp_path))
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_FILE"].startswith(str(tmp_path))
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    assert transport_log_env(str(tmp_path)) == {}


def test_emulated_hosts_are_not_a_fast_link(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    assert find_link(4).fast and not find_link(4, emulated_hosts=2).fast


@pytest.mark.parametrize("flags, message", [
    (["--emulate-hosts", "3"], "must divide the 2 ranks"),
    (["--emulate-hosts", "0"], "must be >= 1"),
    (["--nccl-transport-report"], "needs a CUDA device"),
])
def test_emulated_host_errors_name_the_flag(flags, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = TINY + ["--expert-model-parallel-size", "2", "--device", "cpu"] + flags
    with pytest.raises(ConfigError) as err:
        validate_config(parse_config(argv), 2, cuda_available=False)
    assert flags[0] in str(err.value) and message in str(err.value)


GPU_RUN = ["--preset", "tiny", "--train-iters", "3", "--expert-model-parallel-size", "2"]


@pytest.mark.multigpu
@needs_gpus
def test_two_emulated_hosts_talk_over_nccls_network_transport(tmp_path):
    out, _ = train_cli(tmp_path, "emulated_hosts", 2, GPU_RUN + ["--emulate-hosts", "2"])
    between = [line for line in out.splitlines() if "(between hosts)" in line]
    assert between and all("NET/" in line for line in between), out[-3000:]
    out, _ = train_cli(tmp_path, "one_host", 2, GPU_RUN + ["--nccl-transport-report"])
    inside = [line for line in out.splitlines() if "(in a host)" in line]
    assert inside and not any("NET/" in line for line in inside), out[-3000:]
