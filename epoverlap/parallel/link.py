"""Which link the expert-parallel all-to-all crosses, from the hardware.

Owns `LinkFacts` (what decides it: peer access between the local GPUs, NVLink as NVML reports
it, NCCL_P2P_DISABLE, the hosts and the GPUs of one host), `decide_link` (facts -> `Link`: its
kind, whether it is fast, and why; a pure function), `probe_facts` (the facts on this machine)
and `find_link` (both). The auto graph scope (`config.resolve`) asks it.

The rules, first match wins:

  several hosts (or --emulate-hosts N)    network      slow  (bytes cross between hosts)
  NCCL_P2P_DISABLE set                    host memory  slow  (NCCL copies through host memory)
  one GPU on the one host                 none         fast  (the all-to-all crosses no link)
  no peer access between the local GPUs   host memory  slow
  NVLink on every local GPU (NVML)        nvlink       fast
  no NVLink on some local GPU (NVML)      pcie         slow  (peer access over PCIe at best)
  peer access, NVML absent                peer         fast  (decided by peer access alone)
  neither known (not probed)              unknown      fast  (as when the environment alone
                                                            decided)

Every rank must decide alike, and `config.resolve` runs before any process group: the probe
reads only what every rank of a host sees alike, the environment, NVML and the local GPUs
0..L-1 (one per local rank: `parallel.groups` puts rank r on cuda:LOCAL_RANK), and only where
each rank sees all L of them (a rank that sees fewer probes nothing: unknown). Ranks on
different hosts need no agreement: several hosts are decided before any probe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from epoverlap.parallel.transport import ranks_per_host

P2P_OFF = ("1", "true", "yes")  # NCCL_P2P_DISABLE values that switch peer-to-peer off


@dataclass(frozen=True)
class LinkFacts:
    """What decides the link. None: not known (not probed, or no NVML)."""

    peer_access: Optional[bool]  # every pair of the local GPUs can access each other
    nvlink: Optional[bool]  # every local GPU has an active NVLink (NVML)
    p2p_disabled: bool  # NCCL_P2P_DISABLE set
    hosts: int  # the job's hosts (emulated ones count)
    gpus: int = 2  # the GPUs of one host the job uses (its local ranks)
    emulated: bool = False  # the hosts are --emulate-hosts' on one machine


@dataclass(frozen=True)
class Link:
    kind: str  # network, none, host memory, nvlink, pcie, peer, unknown
    fast: bool  # bytes do not bind: one graph of the whole iteration over the budget pays
    reason: str

    def text(self) -> str:
        """`pcie (peer access between the 2 local GPUs, NVLink not on each, per NVML)`."""
        return f"{self.kind} ({self.reason})"


def decide_link(facts: LinkFacts) -> Link:
    """The link the facts describe (the module docstring's rules, in order)."""
    f, gpus = facts, f"the {facts.gpus} local GPUs"
    if f.hosts > 1:
        return Link("network", False, f"{f.hosts} {'emulated ' if f.emulated else ''}hosts")
    if f.p2p_disabled:
        return Link("host memory", False, "NCCL_P2P_DISABLE set")
    if f.gpus <= 1:
        return Link("none", True, "one GPU")
    if f.peer_access is False:
        return Link("host memory", False, f"no peer access between {gpus}")
    peer = (f"peer access between {gpus}" if f.peer_access
            else f"peer access between {gpus} not probed")
    if f.nvlink:
        return Link("nvlink", True, f"{peer}, NVLink on each, per NVML")
    if f.nvlink is False:
        return Link("pcie", False, f"{peer}, NVLink not on each, per NVML")
    if f.peer_access:
        return Link("peer", True, f"{peer}; NVLink unknown: no NVML")
    return Link("unknown", True, f"{peer} (no CUDA device here, or not all {gpus} seen); "
                                 "taken as fast")


def find_link(world_size: int, emulated_hosts: int = 1) -> Link:
    """This job's link: the facts (probed only where one host has several GPUs), decided."""
    return decide_link(probe_facts(world_size, emulated_hosts))


def probe_facts(world_size: int, emulated_hosts: int = 1) -> LinkFacts:
    """The facts on this machine: hosts from torchrun's LOCAL_WORLD_SIZE (Slurm's
    SLURM_NNODES without it) or --emulate-hosts; the GPUs probed only on one host with two or
    more local ranks, on CUDA, each rank seeing all of them."""
    p2p_off = os.environ.get("NCCL_P2P_DISABLE", "0").strip().lower() in P2P_OFF
    hosts = emulated_hosts if emulated_hosts > 1 else _hosts(world_size)
    gpus = min(world_size, ranks_per_host(world_size))
    peer = nvlink = None
    if hosts == 1 and gpus > 1 and _sees(gpus):
        peer, nvlink = _peer_access(gpus), _nvlink(gpus)
    return LinkFacts(peer, nvlink, p2p_off, hosts, gpus, emulated=emulated_hosts > 1)


def _hosts(world_size: int) -> int:
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None:
        return max(1, -(-world_size // max(1, int(local))))
    return max(1, int(os.environ.get("SLURM_NNODES", "1")))


def _sees(gpus: int) -> bool:
    """Whether this process sees the host's `gpus` local GPUs (never true on CPU)."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= gpus


def _peer_access(gpus: int) -> bool:
    """Every ordered pair of GPUs 0..gpus-1 can access the other's memory (a device query:
    no CUDA context is made)."""
    return all(torch.cuda.can_device_access_peer(a, b)
               for a in range(gpus) for b in range(gpus) if a != b)


def _nvlink(gpus: int) -> Optional[bool]:
    """Whether NVML reports an active NVLink on every GPU 0..gpus-1 (found by its UUID);
    None without NVML (nvidia-ml-py not installed, or no driver library), or where it fails."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        return all(_has_nvlink(pynvml, _handle(pynvml, gpu)) for gpu in range(gpus))
    except (pynvml.NVMLError, AttributeError, RuntimeError):
        return None
    finally:
        pynvml.nvmlShutdown()


def _handle(pynvml, gpu: int):
    uuid = str(torch.cuda.get_device_properties(gpu).uuid)
    return pynvml.nvmlDeviceGetHandleByUUID(
        (uuid if uuid.startswith("GPU-") else f"GPU-{uuid}").encode())


def _has_nvlink(pynvml, handle) -> bool:
    """An NVLink of this GPU is active. A link the GPU does not have (or a GPU with none)
    raises NotSupported or InvalidArgument: not one; any other NVML error propagates."""
    absent = tuple(getattr(pynvml, name) for name in (
        "NVMLError_NotSupported", "NVMLError_InvalidArgument") if hasattr(pynvml, name))
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                return True
        except absent:
            continue
    return False
