"""How the layers are split over pipeline stages and their virtual stages (model chunks).

Owns `ChunkPlacement` and `stage_chunks`, Megatron-core's split: with P pipeline stages and V
model chunks per stage (virtual stages; V = 1 without them), the N layers are cut into P x V
chunks of N / (P x V) consecutive layers, and global chunk g = v x P + p lives on stage p as its
chunk v. Chunk g's input comes from chunk g - 1 (on stage (g - 1) mod P) and its output goes to
chunk g + 1; chunk 0 starts with the embedding and the last chunk ends with the loss head.

    P=2, V=2, 8 layers:  stage 0: chunk 0 = L0 L1, chunk 1 = L4 L5
                         stage 1: chunk 0 = L2 L3, chunk 1 = L6 L7

Pure arithmetic (no torch, no process groups): the config validation, the model and the
memory check before any process group all use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ChunkPlacement:
    """One model chunk: where it lives and who feeds it."""

    stage: int
    virtual: int  # v: the chunk's index on its stage
    layers: range  # global layer indices
    prev_stage: Optional[int]  # stage of the chunk before (None: this chunk has the embedding)
    next_stage: Optional[int]  # stage of the chunk after (None: this chunk has the loss head)

    @property
    def has_embedding(self) -> bool:
        return self.prev_stage is None

    @property
    def has_loss(self) -> bool:
        return self.next_stage is None


def stage_chunks(num_layers: int, stages: int, virtual: int, stage: int) -> list[ChunkPlacement]:
    """The chunks of `stage`, in virtual order. Needs num_layers divisible by stages x virtual."""
    total = stages * virtual
    if num_layers % total or not 0 <= stage < stages:
        raise ValueError(f"{num_layers} layers do not split into {stages} stages x {virtual} "
                         f"virtual stages (stage {stage})")
    per_chunk = num_layers // total
    chunks = []
    for v in range(virtual):
        g = v * stages + stage
        chunks.append(ChunkPlacement(
            stage=stage, virtual=v, layers=range(g * per_chunk, (g + 1) * per_chunk),
            prev_stage=None if g == 0 else (g - 1) % stages,
            next_stage=None if g == total - 1 else (g + 1) % stages))
    return chunks


def stage_layers(num_layers: int, stages: int, virtual: int, stage: int) -> list[int]:
    """Every global layer index `stage` holds, in forward order of its chunks."""
    return [layer for chunk in stage_chunks(num_layers, stages, virtual, stage)
            for layer in chunk.layers]


def describe_layers(layers: list[int]) -> str:
    """[0, 1, 4, 5] -> 'L0-1, L4-5'."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(f"L{r[0]}" if len(r) == 1 else f"L{r[0]}-{r[-1]}" for r in runs)
