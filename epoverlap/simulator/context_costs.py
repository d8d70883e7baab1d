"""The K/V exchange of context parallelism (CP, `model.context`) in the simulator: its bytes
from the model shape and its time on a link, per layer and phase.

Owns `KvShape` (what sets the exchange's bytes: this rank's [K, V] of one microbatch) and
`kv_exchange_us`, the time of one layer's exchange by --cp-comm-type:

  allgather  the `kv_gather` node on the comm lane: forward, every rank's [K, V] gathered
             (a rank receives the (CP - 1) / CP of the gathered K/V the other ranks hold, and
             sends its own to each of them: (CP - 1) x its K/V bytes leave it); backward, the
             K/V grads sent back to their owners (an all-to-all of the same bytes) and summed.
             One collective call each way.
  p2p        the ring inside the `attn` node (compute lane, which it blocks: the runtime
             runs it there, `model.context`): CP - 1 steps each way, a step passing one
             rank's [K, V] (its grads, backward) to the next rank, one call per step.

Time = calls x the link's latency + the bytes leaving a GPU over its bandwidth; a CP group no
larger than a node of `gpus_per_node` GPUs (CP groups are blocks of consecutive ranks,
`parallel.groups`) goes over NVLink. The engine couples a comm-lane action over every
simulated rank; a CP group's ranks are alike, so its all-gather's time is the same whether its
group is the EP group or not. Times in microseconds, bandwidths in GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from epoverlap.schedule.plan import Action
from epoverlap.simulator.costs import LinkModel

GATHER_NODE = "kv_gather"  # the all-gather's node (model.transformer)
RING_NODE = "attn"  # the node the ring runs in


@dataclass(frozen=True)
class KvShape:
    """One microbatch's K and V on one rank: B sequences x G key/value heads x s = S / CP
    local tokens x D head dim, each `dtype_bytes` wide; `cp` ranks in the group; each layer's
    --cp-comm-type."""

    batch: int
    kv_heads: int
    local_tokens: int
    head_dim: int
    dtype_bytes: int
    cp: int
    comm_types: tuple[str, ...]

    @classmethod
    def from_config(cls, cfg) -> "KvShape":
        m, cp = cfg.model, cfg.parallel.context_parallel_size
        return cls(batch=cfg.train.micro_batch_size, kv_heads=m.kv_heads,
                   local_tokens=m.seq_length // cp, head_dim=m.head_dim,
                   dtype_bytes=2 if cfg.train.bf16 else 4, cp=cp,
                   comm_types=tuple(cfg.cp_comm_types()))

    @property
    def kv_bytes(self) -> int:
        """This rank's [K, V] of one microbatch: 2 x B x G x s x D elements."""
        return 2 * self.batch * self.kv_heads * self.local_tokens * self.head_dim * \
            self.dtype_bytes

    def comm_type(self, layer: Optional[int]) -> Optional[str]:
        """The layer's exchange (None: no CP, or not a transformer layer)."""
        if self.cp < 2 or layer is None:
            return None
        return self.comm_types[layer]


def exchange_volume(shape: KvShape, comm_type: str) -> tuple[int, int]:
    """(bytes leaving a rank, calls) of one layer's exchange in one phase (forward, or the
    backward's grads: the same bytes the other way)."""
    if comm_type == "allgather":
        return (shape.cp - 1) * shape.kv_bytes, 1
    return (shape.cp - 1) * shape.kv_bytes, shape.cp - 1  # ring: CP - 1 steps of one block


def cp_bandwidth_gbs(link: LinkModel, cp: int) -> float:
    """The per-GPU bandwidth a CP group's transfers take: NVLink inside a node."""
    if link.gpus_per_node and cp <= link.gpus_per_node and link.nvlink_gbs:
        return link.nvlink_gbs
    return link.bandwidth_gbs


def kv_exchange_us(link: LinkModel, shape: KvShape, comm_type: str) -> float:
    """One layer's K/V exchange in one phase, on `link` (module doc)."""
    sent, calls = exchange_volume(shape, comm_type)
    return calls * link.latency_us + sent / (cp_bandwidth_gbs(link, shape.cp) * 1e3)


def is_gather(action: Action) -> bool:
    return action.node == GATHER_NODE and action.kind in ("F", "B")


def ring_us(link: LinkModel, shape: KvShape, action: Action) -> float:
    """The ring's transfers an `attn` F or B action waits for (0 for any other action, or a
    layer that gathers)."""
    if action.node != RING_NODE or action.kind not in ("F", "B") \
            or shape.comm_type(action.layer) != "p2p":
        return 0.0
    return kv_exchange_us(link, shape, "p2p")


def gather_local_us(link: LinkModel, shape: KvShape) -> float:
    """The compute-only baseline's stand-in for a gather: the gathered K/V copied locally."""
    return shape.cp * shape.kv_bytes / (link.local_gbs * 1e3)
