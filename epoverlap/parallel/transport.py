"""Which link NCCL really uses between which ranks, and emulated hosts on one machine.

Owns `nccl_host_identity` (the host NCCL takes a process to be on), `ranks_per_host` (how many
consecutive ranks share a host, real or emulated), `emulated_host_id` (the
NCCL host identity of a rank under --emulate-hosts N: NCCL reads NCCL_HOSTID, when set, instead
of hashing the host name, once per process, at its first communicator; ranks with different
identities are different hosts to NCCL, so it connects them over its network transport,
sockets over the machine's interface here, and ranks of one identity over NVLink or host
memory), `transport_log_env` (NCCL_DEBUG=INFO into a file of this process's own, so NCCL's
connection lines can be read back) and `TransportReport` (those lines parsed, gathered over the
ranks, printed, and checked: between two emulated hosts only the network transport may carry a
byte, so nobody measures the wrong link by accident).

NCCL's connection line, one per channel and peer, written as a connection is set up (the
all-to-all's peers connect at its first use):

    Channel 02/1 : 0[0] -> 1[1] [send] via NET/Socket/0
    Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read

The transport is the first word after `via`: P2P (NVLink or PCIe peer access), SHM (host
memory), NET (the network plugin: Socket, IB), COLLNET.

Both settings must be in the environment before this process's first NCCL communicator
(`training.setup.environment.setup_environment` sets them, before `init_distributed`).
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch.distributed as dist

NETWORK = "NET"
_LINE = re.compile(r"Channel \d+/\d+ : (\d+)\[\d+\] -> (\d+)\[\d+\](?: \[(?:send|receive)\])?"
                   r" via (\S+)")


def emulated_host_id(local_rank: int, local_world: int, hosts: int,
                     machine: Optional[str] = None) -> str:
    """The NCCL host identity of local rank `local_rank` when the machine's `local_world`
    ranks are split into `hosts` emulated hosts of consecutive local ranks."""
    if hosts < 1 or local_world % hosts:
        raise ValueError(f"{local_world} local ranks do not split into {hosts} hosts")
    host = local_rank // (local_world // hosts)
    return f"{machine or socket.gethostname()}-emulated-host-{host}"


def ranks_per_host(world_size: int, emulated_hosts: int = 1) -> int:
    """The ranks of one host: torchrun's LOCAL_WORLD_SIZE (the world without it), split by
    --emulate-hosts. Ranks of one host are consecutive (torchrun numbers a node's ranks
    together)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, local // max(1, emulated_hosts))


def nccl_host_identity() -> str:
    """The host NCCL takes this process to be on: NCCL_HOSTID when set, else the host name."""
    return os.environ.get("NCCL_HOSTID") or socket.gethostname()


def transport_log_env(folder: Optional[str] = None) -> dict:
    """The environment that makes NCCL write its INFO log, connection lines included, to a
    file of this process (empty when NCCL_DEBUG is already set: the user's log is theirs)."""
    if os.environ.get("NCCL_DEBUG"):
        return {}
    folder = folder or tempfile.gettempdir()
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,P2P,NET",
            "NCCL_DEBUG_FILE": str(Path(folder) / f"epoverlap-nccl-{os.getpid()}.log")}


def parse_transports(text: str) -> dict[tuple[int, int], set[str]]:
    """NCCL's connection lines -> {(from rank, to rank): transports named}."""
    pairs: dict[tuple[int, int], set[str]] = {}
    for match in _LINE.finditer(text):
        source, target, via = int(match.group(1)), int(match.group(2)), match.group(3)
        pairs.setdefault((source, target), set()).add(via)
    return pairs


def transport_kind(via: str) -> str:
    """'NET/Socket/0' -> 'NET'; 'P2P/CUMEM/read' -> 'P2P'."""
    return via.split("/", 1)[0]


@dataclass
class TransportReport:
    """The connections every rank's NCCL log names, with each rank's host identity."""

    hosts: list[str]  # per global rank
    pairs: dict = field(default_factory=dict)  # (from, to) -> transports named

    def lines(self) -> list[str]:
        if not self.pairs:
            return ["transport: NCCL named no connection (its log holds no connection line)"]
        out = []
        for (source, target), vias in sorted(self.pairs.items()):
            where = "between hosts" if self.hosts[source] != self.hosts[target] else "in a host"
            out.append(f"transport: rank {source} -> {target} ({where}): "
                       f"{', '.join(sorted(vias))}")
        return out

    def problems(self) -> list[str]:
        """Connections between two hosts over anything but the network transport, and host
        pairs NCCL named no connection between (nothing crossed: nothing was measured)."""
        wrong = [f"rank {s} -> {t}: {', '.join(sorted(v))}" for (s, t), v in
                 sorted(self.pairs.items()) if self.hosts[s] != self.hosts[t]
                 and any(transport_kind(via) != NETWORK for via in v)]
        crossed = any(self.hosts[s] != self.hosts[t] for s, t in self.pairs)
        if len(set(self.hosts)) > 1 and not crossed:
            wrong.append("no connection between two hosts was named")
        return wrong


def gather_report(log_file: Optional[str], host: str) -> Optional[TransportReport]:
    """Every rank reads its own NCCL log (`log_file`) and the reports are gathered over the
    world group; -> the whole report on every rank (None where no rank had a log to read)."""
    pairs: dict = {}
    if log_file and Path(log_file).exists():
        pairs = parse_transports(Path(log_file).read_text(errors="replace"))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (host, bool(log_file), pairs))
    if not any(had_log for _, had_log, _ in gathered):
        return None
    report = TransportReport([h for h, _, _ in gathered])
    for _, _, rank_pairs in gathered:
        for pair, vias in rank_pairs.items():
            report.pairs.setdefault(pair, set()).update(vias)
    return report
