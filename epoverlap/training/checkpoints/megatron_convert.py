"""The two conversions of `epoverlap-convert-checkpoint`: a Megatron-core torch_dist checkpoint
to an epoverlap checkpoint (`from_megatron`) and back (`to_megatron`). The tensor mapping is
`training.checkpoints.megatron_mapping`, the folders `training.checkpoints.megatron_checkpoint`.

Both check every tensor's name and shape against the epoverlap model of the config before
reading any data, in the model's parameter order, and refuse at the first that differs
(ConversionError, one line naming the tensor and the flags that size it); a Megatron-core
tensor with no place in the model is refused the same way, with what it is. Values are copied
exactly: a round trip epoverlap -> Megatron-core -> epoverlap gives every tensor's bits back.

Optimizer state is not converted either way: Megatron-core's distributed optimizer keeps it in
layouts of its own (flat buffers per data-parallel group by default), not per parameter, so the
converted checkpoint holds the weights alone and a run loading it starts with a fresh optimizer
(the random state, too, is the one --seed gives).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from epoverlap.config import RunConfig
from epoverlap.errors import CheckpointError
from epoverlap.training.checkpoints import checkpoint_files as files
from epoverlap.training.checkpoints.megatron_checkpoint import (COMMON, LAYOUTS, PER_LAYER,
                                                                MegatronCheckpoint, default_layout,
                                                                find_megatron_folder, megatron_args,
                                                                megatron_entries, quiet_dcp,
                                                                unmapped_reason, write_epoverlap,
                                                                write_megatron)
from epoverlap.training.checkpoints.megatron_mapping import (EMBEDDING, OUTPUT_LAYER,
                                                             ConversionError, TensorMap,
                                                             check_megatron_args, config_from_meta,
                                                             tensor_maps)

OPTIMIZER_NOTE = ("optimizer state: not converted (Megatron-core's distributed optimizer keeps "
                  "it in flat per-group buffers, not per parameter); weights only, so a run "
                  "loading this starts with a fresh optimizer")
_MISSING_HINT = {"router": "--num-experts, --moe-layer-freq, --moe-first-k-dense-replace",
                 "experts": "--num-experts, --moe-layer-freq, --moe-first-k-dense-replace",
                 "dense_mlp": "--moe-layer-freq, --moe-first-k-dense-replace",
                 "shared_expert": "--moe-shared-expert-intermediate-size"}


@dataclass
class Converted:
    path: Path  # the checkpoint folder written
    step: int
    tensors: int
    notes: list[str] = field(default_factory=list)  # lines for the user


# ------------------------------------------------------------------- Megatron -> epoverlap
def from_megatron(source: str, out: str, cfg: RunConfig, step: Optional[int] = None, *,
                  untie: bool = False, trim_vocab: bool = False) -> Converted:
    """Megatron-core checkpoint SOURCE (its folder, or a save folder: --step's iteration, else
    the newest) -> OUT/iter_NNNNNNN, an epoverlap checkpoint of the same step for `cfg`'s
    model. `untie`: a checkpoint without output_layer.weight (tied to the embedding) gives its
    embedding to epoverlap's separate output head. The embedding and output layer hold the
    vocabulary padded as --make-vocab-size-divisible-by says (Megatron-LM's padding, its rows
    kept); `trim_vocab`: ones padded to more rows keep their first rows."""
    folder, iteration = find_megatron_folder(source, step)
    ckpt = MegatronCheckpoint(folder)
    if iteration is None:  # a folder not named by its iteration: Megatron-LM's common.pt says
        saved = (ckpt.common or {}).get("iteration")
        iteration = saved if isinstance(saved, int) and saved >= 0 else 0
    notes = []
    if ckpt.args is not None:
        check_megatron_args(ckpt.args, cfg, str(folder / COMMON))
        notes.append("checked the flags against the Megatron-LM arguments in common.pt")
    else:
        why = ckpt.common_problem or "common.pt holds no Megatron-LM args"
        notes.append(f"{why}: the router's top-k and score function, the rotary base and the "
                     "norm epsilon are not in the tensors, so they are the flags' as given")
    maps = tensor_maps(cfg)
    sources = {m.ours: _located(ckpt, m, cfg, folder, untie, trim_vocab) for m in maps}
    used = {key for source in sources.values() for key in source.keys}
    for key in ckpt.model_keys():
        if key not in used:
            raise ConversionError(f"{folder}: {key} {list(ckpt.tensors[key])} has no place in "
                                  f"epoverlap's model: {unmapped_reason(key)}")
    raw = ckpt.read(sorted(used))
    values = {m.ours: m.to_ours(sources[m.ours].build(raw).float()).contiguous() for m in maps}
    del raw
    if ckpt.has_optimizer_state():
        notes.append(OPTIMIZER_NOTE)
    else:
        notes.append("weights only (no optimizer state in the checkpoint): a run loading this "
                     "starts with a fresh optimizer")
    path = write_epoverlap(out, iteration, cfg, maps, values,
                           {"megatron_checkpoint": str(folder.resolve())})
    return Converted(path, iteration, len(maps), notes)


def _located(ckpt: MegatronCheckpoint, m: TensorMap, cfg: RunConfig, folder: Path,
             untie: bool, trim_vocab: bool):
    num_layers, num_experts = cfg.model.num_layers, cfg.moe.num_experts or 0
    source = ckpt.locate(m, num_layers, num_experts)
    if source is None and m.megatron == OUTPUT_LAYER:
        if not untie:
            raise ConversionError(
                f"{folder}: {OUTPUT_LAYER} is not in the checkpoint: its output layer is tied "
                "to the embedding (Megatron-LM without --untie-embeddings-and-output-weights); "
                "epoverlap's output head is a tensor of its own: --untie-embeddings copies the "
                "embedding into it")
        source = ckpt.locate(_renamed(m, EMBEDDING), num_layers, num_experts)
    if source is None:
        hint = next((f" ({flags})" for part, flags in _MISSING_HINT.items() if part in m.ours),
                    "")
        if m.buffer:
            hint = " (--moe-router-enable-expert-bias)"
        raise ConversionError(f"{folder}: {m.megatron} {list(m.megatron_shape)} (epoverlap's "
                              f"{m.ours}) is not in the checkpoint{hint}")
    expected = m.megatron_shape
    if m.megatron in (EMBEDDING, OUTPUT_LAYER) and source.shape[1:] == expected[1:]:
        _vocab_rows(source, m, cfg, ckpt, folder, trim_vocab)
    elif source.shape != expected:
        raise ConversionError(
            f"{folder}: {source.names} is {list(source.shape)} there, {list(expected)} for "
            f"epoverlap's {m.ours} from these flags ({m.sized_by})")
    return source


def _vocab_rows(source, m: TensorMap, cfg: RunConfig, ckpt: MegatronCheckpoint, folder: Path,
                trim_vocab: bool) -> None:
    """An embedding or output layer `source` of the right width: its rows are the padded
    vocabulary's (kept as they are), or more with `trim_vocab` (the first ones kept); any other
    row count is refused, naming the padding multiple that would match."""
    rows, expected = source.shape[0], m.megatron_shape
    if rows == expected[0]:
        return
    if trim_vocab and rows > expected[0]:
        build = source.build
        source.build, source.shape = (lambda t: build(t)[:expected[0]]), expected
        return
    model = cfg.model
    ours = (f"the vocabulary {model.vocab_size} padded to a multiple of "
            f"--make-vocab-size-divisible-by {model.make_vocab_size_divisible_by}")
    if rows < model.vocab_size:
        hint = f"fewer rows than the vocabulary: {m.sized_by}"
    else:
        multiple = _megatron_multiple(ckpt)
        known = multiple is not None and rows == replace(
            model, make_vocab_size_divisible_by=multiple).padded_vocab_size
        same = (f"--make-vocab-size-divisible-by {multiple}" if known else
                "the Megatron-LM run's --make-vocab-size-divisible-by x its "
                "--tensor-model-parallel-size")
        hint = f"Megatron-LM padded it differently: give {same}" + (
            f", or --trim-vocab keeps the first {expected[0]} rows" if rows > expected[0]
            else "")
    raise ConversionError(f"{folder}: {source.names} is {list(source.shape)} there, "
                          f"{list(expected)} for epoverlap's {m.ours} ({ours}); {hint}")


def _megatron_multiple(ckpt: MegatronCheckpoint) -> Optional[int]:
    """The Megatron-LM run's vocabulary padding multiple, from common.pt's args (None when
    they do not say)."""
    args = ckpt.args
    divisor = getattr(args, "make_vocab_size_divisible_by", None)
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    return divisor * tp if isinstance(divisor, int) and isinstance(tp, int) else None


def _renamed(m: TensorMap, megatron: str) -> TensorMap:
    return replace(m, megatron=megatron)


# ------------------------------------------------------------------- epoverlap -> Megatron
def to_megatron(source: str, out: str, cfg: Optional[RunConfig] = None,
                step: Optional[int] = None, layout: str = "auto") -> Converted:
    """Epoverlap checkpoint SOURCE (its folder, or a save folder: --step's, else the newest) ->
    OUT/iter_NNNNNNN, a Megatron-core torch_dist checkpoint of the same step that
    `dist_checkpointing.load` reads into a GPTModel of this model's config (untied output
    layer, local or TE spec). The model is the checkpoint's own (its meta.json config), or
    `cfg`'s, whose every tensor must then be in the checkpoint with its shape."""
    if layout not in LAYOUTS:
        raise ConversionError(f"--megatron-layout {layout}: one of {', '.join(LAYOUTS)}")
    path = (files.checkpoint_folder(source, step) if step is not None
            else files.newest_complete(source))
    if path is None or not files.is_complete(path):
        raise ConversionError(f"{path or source}: no complete epoverlap checkpoint there (an "
                              f"iter_NNNNNNN folder with {files.META} and {files.DCP_INDEX})")
    try:
        ref = files.read_checkpoint(path, source)
    except CheckpointError as error:
        raise ConversionError(error.allowed) from None
    cfg = cfg if cfg is not None else config_from_meta(ref.meta["config"])
    maps = tensor_maps(cfg)
    values = read_epoverlap(ref, maps, cfg)
    layout = default_layout(cfg) if layout == "auto" else layout
    entries = megatron_entries(maps, values, cfg, layout)
    common = {"checkpoint_version": 3.0, "iteration": ref.step,
              "content_metadata": {"singleton_local_shards": False,
                                   "non_homogeneous_layers": layout == PER_LAYER},
              "args": megatron_args(cfg, ref.step)}
    written = write_megatron(out, ref.step, entries, common)
    notes = [f"layout: {layout} layer keys (content metadata non_homogeneous_layers="
             f"{layout == PER_LAYER}); output layer untied"]
    if ref.meta.get("optimizer_state"):
        notes.append("optimizer state: not converted (epoverlap keeps Adam's moments per "
                     "parameter; Megatron-core's distributed optimizer has layouts of its own); "
                     "weights only: load with --finetune --no-load-optim --no-load-rng")
    return Converted(written, ref.step, len(maps), notes)


def read_epoverlap(ref: files.CheckpointRef, maps: list[TensorMap],
                    cfg: RunConfig) -> dict[str, torch.Tensor]:
    """Every tensor of `maps` from the checkpoint, whole (experts stacked by global index);
    the checkpoint's model/ and buffer/ keys must be exactly these, with these shapes."""
    values, entries, expected = {}, {}, {}
    for m in maps:
        values[m.ours] = torch.empty(m.shape, dtype=torch.float32)
        if m.buffer:
            entries[f"buffer/{m.ours}"] = values[m.ours]
        elif m.expert:
            entries.update({f"model/{m.ours}/expert/{g}": values[m.ours][g]
                            for g in range(m.shape[0])})
        else:
            entries[f"model/{m.ours}"] = values[m.ours]
    expected = {key: tuple(tensor.shape) for key, tensor in entries.items()}
    saved = {key: tuple(meta.size) for key, meta in ref.index.state_dict_metadata.items()
             if key.startswith(("model/", "buffer/"))}
    for key in sorted(expected.keys() | saved.keys()):
        if key not in saved:
            problem = f"{key} {list(expected[key])} is not in the checkpoint"
        elif key not in expected:
            problem = f"{key} {list(saved[key])} is in the checkpoint, not in this model"
        elif saved[key] != expected[key]:
            problem = f"{key} is {list(saved[key])} there, {list(expected[key])} here"
        else:
            continue
        raise ConversionError(f"{ref.path}: written for another model: {problem}")
    with quiet_dcp():
        dcp.load(entries, storage_reader=FileSystemReader(str(ref.path)), no_dist=True)
    return values
