"""Megatron-core torch_dist checkpoints read into, and written from, epoverlap checkpoints
(`epoverlap-convert-checkpoint`; which tensor is which: `training.checkpoints.megatron_mapping`).

A Megatron-core checkpoint folder (what `dist_checkpointing.save` writes, and Megatron-LM's
SAVE/iter_NNNNNNN with --ckpt-format torch_dist):

    metadata.json      {"sharded_backend": "torch_dist", ...}
    .metadata          torch.distributed.checkpoint's index: every key, its *global* shape
    __R_T.distcp       the data
    common.pt          what is not sharded (Megatron-LM: args, iteration, content_metadata)

Each key is a global tensor whatever the EP, TP, PP (or virtual-pipeline) sizes were when it was
saved, so they do not matter here. A decoder layer's tensors are laid out one of three ways,
depending on the model and on the metadata it was saved with; all three are read:

  stacked    decoder.layers.NAME, [L, ...] (experts [L, E, ...])  every layer alike and
             moe_layer_freq the int 1 (Megatron-core's default layout)
  per layer  decoder.layers.I.NAME (experts [E, ...])             a moe_layer_freq list or
             > 1, or non_homogeneous_layers in the metadata
  singleton  decoder.layers.I.mlp.experts.experts.G.NAME, a SwiGLU fc1 as NAME_w and NAME_v
             (gate, up)                                           singleton_local_shards

Written: `stacked` where Megatron-core asks for it by default (every layer alike, and
--moe-layer-freq 1 without --moe-first-k-dense-replace), `per layer` otherwise (`layout`); the
content metadata in common.pt says which, so Megatron-LM's --load asks for the same keys. Each
local linear's (empty) `_extra_state` object is written as Megatron-core writes it, since its
load asks for them. Tensors are written in fp32 (epoverlap's master weights): a bf16 Megatron
model rounds them to nearest even on load, as epoverlap does.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import re
import shutil
import types
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType

from epoverlap.config import RunConfig
from epoverlap.training.checkpoints import checkpoint_files as files
from epoverlap.training.checkpoints.megatron_mapping import ConversionError, TensorMap

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}
META = "metadata.json"
COMMON = "common.pt"
STACKED, PER_LAYER = "stacked", "per-layer"
LAYOUTS = ("auto", STACKED, PER_LAYER)
_ITER = re.compile(r"^iter_(\d{7,})$")
# Keys of a Megatron-LM checkpoint that are not the model's (optimizer state, a chained
# optimizer's with its prefix; random and rerun state): not converted
_OPTIMIZER = re.compile(r"^(chained_\d+\.)?optimizer\.")
_NOT_MODEL = re.compile(r"^((chained_\d+\.)?optimizer\.|rng_state|rerun_state_machine)")
# Why a Megatron-core tensor has no place in epoverlap's model
_UNMAPPED = (
    (r"(\.bias|layer_norm_bias)$", "biases (LayerNorm, --add-bias-linear) are not in "
     "epoverlap's model, whose norms are RMSNorm and whose linears have no bias"),
    (r"(q|k)_layernorm", "query/key layer norms: these flags have no --qk-layernorm"),
    (r"position_embeddings", "learned position embeddings are not implemented; epoverlap's "
     "positions are rotary"),
    (r"shared_experts\.gate_weight", "the shared-expert gate (--moe-shared-expert-gate) is not "
     "implemented"),
    (r"(^|\.)mtp\.", "multi-token prediction layers (--mtp-num-layers) are not implemented"),
    (r"linear_(q|kv)_(down|up)_proj|linear_q_proj", "multi-latent attention is not "
     "implemented"),
    (r"router\.expert_bias$", "the router's expert bias: these flags have no "
     "--moe-router-enable-expert-bias"),
    (r"shared_experts\.linear_fc", "a shared expert: these flags have no "
     "--moe-shared-expert-intermediate-size"),
    (r"^decoder\.layers\.\d+\.", "a layer these flags do not have, or not of this kind "
     "(--num-layers, --moe-layer-freq, --moe-first-k-dense-replace)"))


@dataclass
class _Source:
    """Where one Megatron-core tensor is in a checkpoint: the keys read and how they make it."""

    keys: tuple[str, ...]
    shape: tuple
    build: Callable[[dict], torch.Tensor]
    names: str  # the keys as the messages name them


# ---------------------------------------------------------------------------- reading
def find_megatron_folder(path: str, step: Optional[int]) -> tuple[Path, Optional[int]]:
    """A Megatron-core checkpoint folder and its iteration (its iter_NNNNNNN name's, else
    --step's, else None): DIR itself, or DIR/iter_N for --step N, else the one DIR's
    latest_checkpointed_iteration.txt names, else its newest."""
    root = Path(path)
    if step is not None and not (root / META).is_file():
        folder = root / files.iter_name(step)
    elif (root / META).is_file():
        folder = root
    else:
        folder = _tracked_folder(root)
    if not (folder / META).is_file():
        legacy = any(folder.glob("mp_rank_*")) if folder.is_dir() else False
        raise ConversionError(
            f"{folder}: not a torch_dist checkpoint (no {META})"
            + ("; this is a legacy --ckpt-format torch checkpoint: convert it with Megatron-LM "
               "(--ckpt-convert-format torch_dist) first" if legacy else ""))
    backend = _read_json(folder / META)
    if backend.get("sharded_backend") != "torch_dist":
        raise ConversionError(f"{folder / META}: sharded backend "
                              f"{backend.get('sharded_backend')!r}; only torch_dist is read")
    found = _ITER.match(folder.name)
    return folder, int(found.group(1)) if found else step


def _tracked_folder(root: Path) -> Path:
    tracker = root / files.TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        return root / ("release" if text == "release" else files.iter_name(int(text)))
    found = sorted((int(m.group(1)), p) for p in root.glob("iter_*")
                   if (m := _ITER.match(p.name)) and (p / META).is_file())
    if not found:
        raise ConversionError(f"{root}: no Megatron-core checkpoint there ({META}, "
                              f"{files.TRACKER} or iter_NNNNNNN folders)")
    return found[-1][1]


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConversionError(f"{path}: unreadable ({files.first_line(error)})") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{path}: not a JSON object")
    return value


class MegatronCheckpoint:
    """One Megatron-core torch_dist folder: its index, common.pt, and its tensors on demand."""

    def __init__(self, folder: Path):
        self.folder = folder
        try:
            index = FileSystemReader(str(folder)).read_metadata()
        except Exception as error:  # unpickling a damaged index raises anything
            raise ConversionError(f"{folder / files.DCP_INDEX}: unreadable "
                                  f"({type(error).__name__}: {files.first_line(error)})") \
                from None
        self.tensors = {key: tuple(meta.size) for key, meta in index.state_dict_metadata.items()
                        if isinstance(meta, TensorStorageMetadata)}
        self.dtypes = {key: meta.properties.dtype for key, meta
                       in index.state_dict_metadata.items()
                       if isinstance(meta, TensorStorageMetadata)}
        self.common, self.common_problem = read_common(folder / COMMON)

    @property
    def args(self) -> Optional[object]:
        return (self.common or {}).get("args")

    def model_keys(self) -> list[str]:
        return [key for key in self.tensors if not _NOT_MODEL.match(key)]

    def has_optimizer_state(self) -> bool:
        return any(_OPTIMIZER.match(key) for key in self.tensors)

    def _plain(self, key: str) -> Optional[_Source]:
        """`key` itself, or its SwiGLU halves key_w and key_v (gate, up)."""
        if key in self.tensors:
            return _Source((key,), self.tensors[key], lambda t, k=key: t[k], key)
        w, v = key + "_w", key + "_v"
        if w in self.tensors and v in self.tensors:
            sw, sv = self.tensors[w], self.tensors[v]
            shape = (sw[0] + sv[0],) + sw[1:] if sw[1:] == sv[1:] else sw
            return _Source((w, v), shape, lambda t: torch.cat([t[w], t[v]]), f"{w}/_v")
        return None

    def locate(self, m: TensorMap, num_layers: int, num_experts: int) -> Optional[_Source]:
        """Where `m`'s Megatron-core tensor is, in whichever layout; None if nowhere."""
        for name in (m.megatron,) + m.aliases:
            source = self._plain(name)
            if source is not None:
                return source
            if m.layer is None:
                continue
            stacked = self._plain(name.replace(f"decoder.layers.{m.layer}.", "decoder.layers.",
                                               1))
            if stacked is not None:
                if stacked.shape[0] != num_layers:
                    raise ConversionError(f"{self.folder}: {stacked.names} holds "
                                          f"{stacked.shape[0]} layers, these flags "
                                          f"{num_layers} (--num-layers)")
                return _Source(stacked.keys, stacked.shape[1:],
                               lambda t, b=stacked.build, i=m.layer: b(t)[i], stacked.names)
            if m.expert:
                source = self._singleton(name, num_experts)
                if source is not None:
                    return source
        return None

    def _singleton(self, name: str, num_experts: int) -> Optional[_Source]:
        """Experts stored one key each: decoder.layers.I.mlp.experts.experts.G.linear_fcK."""
        head, _, tail = name.rpartition(".linear_fc")
        parts = [self._plain(f"{head}.{g}.linear_fc{tail}") for g in range(num_experts)]
        if not parts or any(p is None for p in parts):
            return None
        shapes = {p.shape for p in parts}
        if len(shapes) != 1:
            raise ConversionError(f"{self.folder}: the experts of {name} differ in shape")
        return _Source(tuple(k for p in parts for k in p.keys), (num_experts,) + parts[0].shape,
                       lambda t: torch.stack([p.build(t) for p in parts]),
                       f"{head}.G.linear_fc{tail}")

    def read(self, keys) -> dict[str, torch.Tensor]:
        """The tensors of `keys`, whole, in their saved dtypes."""
        out = {key: torch.empty(self.tensors[key], dtype=self.dtypes[key]) for key in keys}
        if out:
            with quiet_dcp():
                dcp.load(out, storage_reader=FileSystemReader(str(self.folder)), no_dist=True)
        return out


class _ArgsUnpickler(pickle.Unpickler):
    """Unpickles common.pt without running its code: tensors, containers, argparse and simple
    namespaces; any other class becomes a stand-in holding its arguments and state (Megatron-
    LM's args hold enums and dataclasses of its own, not needed here)."""

    SAFE = {("collections", "OrderedDict"), ("argparse", "Namespace"),
            ("types", "SimpleNamespace"), ("torch._utils", "_rebuild_tensor_v2"),
            ("torch._utils", "_rebuild_parameter"), ("torch", "Size"), ("torch", "device"),
            ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
            ("builtins", "complex"), ("copyreg", "_reconstructor")}

    def find_class(self, module, name):
        if (module, name) in self.SAFE or (module == "torch" and isinstance(
                getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        return types.new_class(name, (_StandIn,))


class _StandIn:
    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


_args_pickle = types.SimpleNamespace(Unpickler=_ArgsUnpickler, load=pickle.load,
                                     __name__="epoverlap_args_pickle")


def read_common(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(common.pt's dict, None), or (None, why it was not read)."""
    if not path.is_file():
        return None, f"no {path.name}"
    try:
        value = torch.load(path, map_location="cpu", weights_only=False,
                           pickle_module=_args_pickle)
    except Exception as error:  # a damaged or unusual file: the tensors are still read
        return None, f"{path.name} unreadable ({type(error).__name__}: {files.first_line(error)})"
    return (value, None) if isinstance(value, dict) else (None, f"{path.name} is not a dict")


def unmapped_reason(key: str) -> str:
    for pattern, why in _UNMAPPED:
        if re.search(pattern, key):
            return why
    return "epoverlap's model has no such tensor"


@contextmanager
def quiet_dcp():
    """DCP warns that it assumes one process when no process group exists."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---------------------------------------------------------------------------- writing
def default_layout(cfg: RunConfig) -> str:
    """The layer layout Megatron-core's sharded state dict asks for by default."""
    pattern, moe = cfg.moe_layer_pattern(), cfg.moe
    alike = all(pattern) or not any(pattern)
    plain = not moe.enabled or (moe.moe_layer_freq.strip() == "1"
                                and not moe.moe_first_k_dense_replace)
    return STACKED if alike and plain else PER_LAYER


def _stacked_key(m: TensorMap) -> str:
    return m.megatron.replace(f"decoder.layers.{m.layer}.", "decoder.layers.", 1)


def _extra_state_keys(m: TensorMap, layout: str, num_layers: int, num_experts: int) -> list:
    """The `_extra_state` objects of `m`'s linear module(s), keyed as Megatron-core keys them."""
    if m.layer is None or not re.search(r"\.linear_(qkv|proj|fc1|fc2)\.weight$", m.megatron):
        return []
    module = (_stacked_key(m) if layout == STACKED else m.megatron)[:-len(".weight")]
    prefix = f"{module}._extra_state/shard_"
    if layout == STACKED:
        if m.expert:
            return [f"{prefix}{m.layer}.{g}_{num_layers}.{num_experts}"
                    for g in range(num_experts)]
        return [f"{prefix}{m.layer}_{num_layers}"]
    if m.expert:
        return [f"{prefix}{g}_{num_experts}" for g in range(num_experts)]
    return [f"{prefix}0_1"]


class _RawBytesPlanner(DefaultSavePlanner):
    """DCP's save planner, but a BytesIO value is written as the bytes it holds (as Megatron-
    core's planner writes its objects, already torch-saved), not torch-saved once more."""

    def transform_object(self, write_item, object):
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)


def _empty_extra_state() -> io.BytesIO:
    """A local linear's extra state as Megatron-core saves it: its sharded objects' data
    ([None]), torch-saved."""
    data = io.BytesIO()
    torch.save([None], data)
    data.seek(0)
    return data


def megatron_entries(maps: list[TensorMap], values: dict, cfg: RunConfig, layout: str) -> dict:
    """Megatron-core's keys -> tensors (fp32) and extra-state objects, in `layout`."""
    num_layers, num_experts = cfg.model.num_layers, cfg.moe.num_experts or 0
    entries: dict = {}
    stacks: dict[str, list] = {}
    for m in maps:
        tensor = m.to_megatron(values[m.ours].float()).contiguous()
        if layout == STACKED and m.layer is not None:
            stacks.setdefault(_stacked_key(m), []).append((m.layer, tensor))
        else:
            entries[m.megatron] = tensor
        for key in _extra_state_keys(m, layout, num_layers, num_experts):
            entries[key] = _empty_extra_state()
    for key, layers in stacks.items():
        if [layer for layer, _ in layers] != list(range(num_layers)):
            raise ConversionError(f"--megatron-layout {STACKED}: {key} is not in every layer "
                                  f"(the layers differ); use {PER_LAYER}")
        entries[key] = torch.stack([tensor for _, tensor in layers])
    return entries


def megatron_args(cfg: RunConfig, step: int) -> argparse.Namespace:
    """The Megatron-LM arguments of this model (common.pt's `args`): its shape, the router's
    options, and that the checkpoint holds no optimizer or random state."""
    m, moe = cfg.model, cfg.moe
    base = m.rotary_base
    values = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.kv_heads,
        group_query_attention=m.kv_heads != m.num_attention_heads, kv_channels=m.head_dim,
        seq_length=m.seq_length, max_position_embeddings=m.seq_length,
        padded_vocab_size=m.padded_vocab_size,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        rotary_base=int(base) if base == int(base) else base,
        rotary_percent=1.0, rotary_interleaved=False, norm_epsilon=m.norm_epsilon,
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
        add_position_embedding=False, untie_embeddings_and_output_weights=True,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=m.qk_layernorm,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, ckpt_format="torch_dist",
        iteration=step, no_save_optim=True, no_save_rng=True)
    if moe.enabled:
        values.update(
            num_experts=moe.num_experts, moe_router_topk=moe.moe_router_topk,
            moe_ffn_hidden_size=moe.moe_ffn_hidden_size or m.ffn_hidden_size,
            moe_shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size,
            moe_layer_freq=[int(x) for x in cfg.moe_layer_pattern()],
            moe_router_score_function=moe.moe_router_score_function,
            moe_router_pre_softmax=moe.moe_router_pre_softmax,
            moe_router_topk_scaling_factor=moe.moe_router_topk_scaling_factor,
            moe_router_num_groups=moe.moe_router_num_groups,
            moe_router_group_topk=moe.moe_router_group_topk,
            moe_router_enable_expert_bias=moe.moe_router_enable_expert_bias)
    return argparse.Namespace(**values)


def write_megatron(out: str, step: int, entries: dict, common: dict) -> Path:
    """OUT/iter_NNNNNNN as Megatron-core's torch_dist folder, renamed into place when complete,
    then OUT/latest_checkpointed_iteration.txt (Megatron-LM's tracker)."""
    final = Path(out) / files.iter_name(step)
    if final.exists():
        raise ConversionError(f"{final}: exists already; remove it or give another --out")
    temp = final.with_name(f".tmp-{final.name}")
    if temp.exists():
        shutil.rmtree(temp)
    temp.mkdir(parents=True)
    with quiet_dcp():
        dcp.save(entries, storage_writer=FileSystemWriter(str(temp), sync_files=True),
                 planner=_RawBytesPlanner(), no_dist=True)
    (temp / META).write_text(json.dumps(BACKEND))
    torch.save(common, temp / COMMON)
    os.replace(temp, final)
    (Path(out) / files.TRACKER).write_text(f"{step}\n")
    return final


def write_epoverlap(out: str, step: int, cfg: RunConfig, maps: list[TensorMap], values: dict,
                    converted_from: dict) -> Path:
    """OUT/iter_NNNNNNN as epoverlap's checkpoint (`training.checkpoints.checkpoint`'s keys, experts
    by global index), without optimizer or random state: --load takes the weights, and the optimizer
    and the random state start as a fresh run's."""
    if files.checkpoint_folder(out, step).exists():
        raise ConversionError(f"{files.checkpoint_folder(out, step)}: exists already; remove it "
                              "or give another --out")
    Path(out).mkdir(parents=True, exist_ok=True)
    temp = files.prepare_temp(out, step)
    entries: dict[str, torch.Tensor] = {}
    for m in maps:
        tensor = values[m.ours].float().contiguous()
        if m.buffer:
            entries[f"buffer/{m.ours}"] = tensor
        elif m.expert:
            entries.update({f"model/{m.ours}/expert/{g}": tensor[g]
                            for g in range(tensor.shape[0])})
        else:
            entries[f"model/{m.ours}"] = tensor
    with quiet_dcp():
        dcp.save(entries, storage_writer=FileSystemWriter(str(temp), sync_files=True),
                 no_dist=True)
    meta = {"format": files.FORMAT, "step": step, "world_size": 1, "ep_size": 1,
            "num_experts": cfg.moe.num_experts or 0, "optimizer_state": False,
            "loss_scale": None, "torch_version": torch.__version__, "config": cfg.to_dict(),
            "converted_from": converted_from}
    return files.publish(temp, out, step, meta)
