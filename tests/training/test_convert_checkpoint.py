"""epoverlap-convert-checkpoint: Megatron-core torch_dist checkpoints to epoverlap checkpoints
and back.

Without megatron-core: a round trip epoverlap -> Megatron-core layout -> epoverlap gives every
tensor's bits back (both layer layouts), and bad input is one line with exit status 2 (a shape
that differs, a tensor epoverlap has no place for, a tied output layer, a Megatron-LM argument
the tensors cannot show).

With megatron-core 0.16.1 (one spawned process, gloo world of 1; its GPTModel built on the CPU
as benchmarks/harness/bench_peer.py builds it, local spec; one model with Qwen3's query/key
norms, --qk-layernorm): a GPTModel with MoE layers is given
seeded weights and saved with `dist_checkpointing.save` (stacked, per-layer and singleton
layouts); the converted checkpoint loaded into epoverlap's model gives Megatron-core's logits on
the same tokens; the conversion back is read by `dist_checkpointing.load` into a fresh GPTModel
bitwise; and the training command resumes from it. Slow tier: the same weights saved at EP 2
convert to the same bits, and EP 2 reads the conversion back.

Logit tolerance (fp32): atol 1e-5 and rtol 1e-5 on logits of magnitude ~1. The two models do
the same math in another order: Megatron-core's attention is baddbmm + softmax where
epoverlap's is SDPA, Megatron-core weights each expert's output by its routing probability
after fc2 where epoverlap does inside the SwiGLU before fc2, the rotary and norm formulas
round differently; each is a few ulps of fp32 (~1e-7 relative) per op, a few layers deep.
Measured: max |diff| 1e-6 on logits up to 2.2 (8e-7 with query/key norms). Routing (top-k)
is discrete: a token whose k-th and (k+1)-th expert scores were within that rounding could
pick another expert and differ by far more; with these seeded weights (router weights 3x the
others') none does, and the weights are fixed, so the test is deterministic. (The all-gather
dispatcher and the inference RNG tracker are used on Megatron-core's side only because its
all-to-all dispatcher and attention RNG fork need CUDA; neither holds weights.)
"""

from __future__ import annotations

import argparse
import enum
import importlib.util
import json
import re
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from checkpoint_workers import checkpoint_tensors
from dist_helpers import one_process_model, run_ranks, single_rank_groups
from epoverlap.cli.convert_checkpoint import main
from epoverlap.config import parse_config
from epoverlap.model.dropout import DROPOUT_SEED
from epoverlap.training.checkpoints.checkpoint import Checkpointer
from epoverlap.training.checkpoints.checkpoint_files import find_resume_checkpoint
from epoverlap.training.checkpoints.megatron_checkpoint import (megatron_entries, read_common,
                                                                write_megatron)
from epoverlap.training.checkpoints.megatron_convert import read_epoverlap
from epoverlap.training.checkpoints.megatron_mapping import (config_from_meta, model_config_of,
                                                             tensor_maps)
from epoverlap.training.optimizer.optim import MixedPrecisionAdamW
from epoverlap.training.loop.trainer import Trainer


def _megatron_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:  # no `megatron` package at all
        return False


# Checked without importing it here: the spawned process imports it (about 5 s on CI).
needs_megatron = pytest.mark.skipif(not _megatron_installed(), reason="megatron-core is not "
                                    "installed (pip install -e '.[peer]')")

SHAPE = ["--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "48", "--moe-ffn-hidden-size", "24", "--num-experts", "4",
         "--moe-router-topk", "2", "--seq-length", "16", "--micro-batch-size", "2",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "63"]
# every layer MoE: Megatron-core's stacked layout
MOE = ["--num-layers", "2"] + SHAPE
# a dense layer, a shared expert and aux-loss-free expert bias: the per-layer layout
MIXED = ["--num-layers", "3", "--moe-layer-freq", "0,1,1",
         "--moe-shared-expert-intermediate-size", "16", "--moe-router-score-function",
         "sigmoid", "--moe-router-enable-expert-bias"] + SHAPE
# Qwen3's attention on the all-MoE model (stacked too): query/key norms (--qk-layernorm) and
# heads wider than --hidden-size / --num-attention-heads (--kv-channels; 32 / 4 = 8 here)
QK_NORM = MOE + ["--qk-layernorm", "--kv-channels", "16"]
VOCAB = 64
PADDED = 128  # the embedding's and output layer's rows: --make-vocab-size-divisible-by 128
STEP = 7
CONFIGS = {"moe": MOE, "mixed": MIXED, "qk_norm": QK_NORM}
STACKED = ("moe", "qk_norm")  # saved in Megatron-core's stacked layout (every layer MoE)


def _with(flags: list, flag: str, value: str) -> list:
    at = flags.index(flag)
    return flags[:at + 1] + [value] + flags[at + 2:]


def _convert(*argv, capsys=None):
    status = main([str(a) for a in argv])
    out = capsys.readouterr() if capsys is not None else None
    return status, out


def _tensors(folder) -> dict:
    return checkpoint_tensors(Path(folder), ("model/", "buffer/"))


def _megatron_tensors(folder) -> dict:
    """Every tensor of a Megatron-core folder (not its linears' extra-state objects)."""
    return checkpoint_tensors(Path(folder), ("embedding.", "decoder.", "output_layer."))


def _same_bits(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.int32), b[k].view(torch.int32))
        for k in a)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Epoverlap checkpoints of both models after 2 steps (optimizer state in them)."""
    root = tmp_path_factory.mktemp("trained")
    for name, flags in CONFIGS.items():
        trainer = Trainer(parse_config(flags + ["--train-iters", "2", "--save",
                                                str(root / name)]),
                          single_rank_groups(), log=lambda msg: None)
        try:
            trainer.train()
        finally:
            trainer.close()
    return root


# --------------------------------------------------------------------------- no megatron-core
@pytest.mark.parametrize("name,layout", [("moe", "auto"), ("moe", "per-layer"),
                                         ("mixed", "auto"), ("qk_norm", "auto")])
def test_round_trip_is_bitwise(trained, tmp_path, capsys, name, layout):
    status, out = _convert("--to-megatron", trained / name, "--out", tmp_path / "m",
                           "--megatron-layout", layout, capsys=capsys)
    assert status == 0, out.err
    expected = "stacked" if name in STACKED and layout == "auto" else "per-layer"
    assert f"layout: {expected} layer keys" in out.out
    assert "optimizer state: not converted" in out.out
    folder = tmp_path / "m" / "iter_0000002"
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp",
                                                        "common.pt", "metadata.json"]
    assert (tmp_path / "m" / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    status, out = _convert("--from-megatron", tmp_path / "m", "--out", tmp_path / "e",
                           *CONFIGS[name], capsys=capsys)
    assert status == 0, out.err
    assert out.out.startswith(f"wrote epoverlap checkpoint {tmp_path / 'e' / 'iter_0000002'} "
                              "(step 2, ")
    assert _same_bits(_tensors(trained / name / "iter_0000002"),
                      _tensors(tmp_path / "e" / "iter_0000002"))


def test_the_mapping_covers_every_tensor_of_the_checkpoint(trained):
    """Every model/ and buffer/ key a training run saves has its Megatron-core tensor."""
    for name, flags in CONFIGS.items():
        maps = tensor_maps(model_config_of(flags, "test"))
        keys = {f"buffer/{m.ours}" if m.buffer else f"model/{m.ours}" for m in maps}
        saved = {re.sub(r"/expert/\d+$", "", key)
                 for key in _tensors(trained / name / "iter_0000002")}
        assert keys == saved
        assert len({m.megatron for m in maps}) == len(maps)


@pytest.fixture(scope="module")
def megatron_folder(trained, tmp_path_factory):
    """The mixed model's checkpoint in Megatron-core's layout."""
    out = tmp_path_factory.mktemp("megatron")
    assert main(["--to-megatron", str(trained / "mixed"), "--out", str(out)]) == 0
    return out


def _refusal(capsys, tmp_path, source, flags, *extra) -> str:
    status, out = _convert("--from-megatron", source, "--out", tmp_path / "e", *extra, *flags,
                           capsys=capsys)
    assert status == 2 and out.out == ""
    lines = out.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("epoverlap-convert-checkpoint: error: ")
    assert not (tmp_path / "e").exists() or not any((tmp_path / "e").iterdir())
    return lines[0]


def test_a_shape_mismatch_is_refused_in_one_line(megatron_folder, tmp_path, capsys):
    line = _refusal(capsys, tmp_path, megatron_folder,
                    _with(MIXED, "--moe-ffn-hidden-size", "32"))
    assert line.endswith("decoder.layers.1.mlp.experts.experts.linear_fc1.weight is "
                         "[4, 48, 32] there, [4, 64, 32] for epoverlap's layers.1.experts.fc1 "
                         "from these flags (--num-experts, --moe-ffn-hidden-size, "
                         "--hidden-size)")
    line = _refusal(capsys, tmp_path, megatron_folder,
                    _with(_with(MIXED, "--num-layers", "2"), "--moe-layer-freq", "0,1"))
    assert "decoder.layers.2." in line and "has no place in epoverlap's model: a layer these " \
                                            "flags do not have" in line
    line = _refusal(capsys, tmp_path, megatron_folder, _with(MIXED, "--vocab-size", "199"))
    assert line.endswith("embedding.word_embeddings.weight is [128, 32] there, [256, 32] for "
                         "epoverlap's embedding (the vocabulary 200 padded to a multiple of "
                         "--make-vocab-size-divisible-by 128); fewer rows than the "
                         "vocabulary: the vocabulary, which the data flags set "
                         "(--tokenizer-type, --vocab-size, --tokenizer-model), padded by "
                         "--make-vocab-size-divisible-by, and --hidden-size")
    line = _refusal(capsys, tmp_path, megatron_folder, MIXED + ["--moe-router-topk", "1"])
    assert line.endswith("common.pt: the Megatron-LM run had --moe-router-topk 2: these flags "
                         "give --moe-router-topk 1")
    line = _refusal(capsys, tmp_path, tmp_path / "nothing", MIXED)
    assert line.endswith("nothing: no Megatron-core checkpoint there (metadata.json, "
                         "latest_checkpointed_iteration.txt or iter_NNNNNNN folders)")


class _AttnBackend(enum.Enum):  # as Megatron-LM's args hold enums of megatron-core's
    flash = 1


def test_megatron_lm_args_are_read_without_running_their_classes(tmp_path):
    torch.save({"iteration": 3, "args": argparse.Namespace(
        moe_router_topk=4, attention_backend=_AttnBackend.flash)}, tmp_path / "common.pt")
    common, problem = read_common(tmp_path / "common.pt")
    assert problem is None and common["iteration"] == 3
    assert common["args"].moe_router_topk == 4
    assert not isinstance(common["args"].attention_backend, _AttnBackend)


def _megatron_copy(source: Path, out: Path, edit) -> Path:
    """The mixed model's Megatron-core folder with its tensors edited by `edit`."""
    ref = find_resume_checkpoint(str(source), None)
    cfg = config_from_meta(ref.meta["config"])
    maps = tensor_maps(cfg)
    entries = megatron_entries(maps, read_epoverlap(ref, maps, cfg), cfg, "per-layer")
    edit(entries)
    write_megatron(str(out), ref.step, entries, {})
    return out


def test_what_does_not_map_is_refused_in_one_line(trained, tmp_path, capsys):
    def qk_norm(entries):
        entries["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(8)
    qk = _megatron_copy(trained / "mixed", tmp_path / "qk", qk_norm)
    line = _refusal(capsys, tmp_path, qk, MIXED)
    assert "decoder.layers.0.self_attention.q_layernorm.weight [8] has no place in " \
           "epoverlap's model: query/key layer norms: these flags have no --qk-layernorm" in line

    tied = _megatron_copy(trained / "mixed", tmp_path / "tied",
                          lambda entries: entries.pop("output_layer.weight"))
    line = _refusal(capsys, tmp_path, tied, MIXED)
    assert "output_layer.weight is not in the checkpoint: its output layer is tied" in line
    assert "--untie-embeddings" in line
    assert main(["--from-megatron", str(tied), "--out", str(tmp_path / "untied"),
                 "--untie-embeddings", *MIXED]) == 0
    untied = _tensors(tmp_path / "untied" / "iter_0000002")
    assert torch.equal(untied["model/head"], untied["model/embedding"])
    capsys.readouterr()


def _padded_to(rows: int):
    """An edit giving the embedding and output layer random padding rows up to `rows`."""
    def pad(entries):
        for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            more = rows - entries[key].shape[0]
            entries[key] = torch.cat([entries[key], torch.randn(more, 32)])
    return pad


def test_a_padded_vocabulary_is_trimmed_on_request(trained, tmp_path, capsys):
    padded = _megatron_copy(trained / "mixed", tmp_path / "padded", _padded_to(192))
    line = _refusal(capsys, tmp_path, padded, MIXED)
    assert "is [192, 32] there, [128, 32]" in line and "--trim-vocab keeps the first 128" in line
    assert main(["--from-megatron", str(padded), "--out", str(tmp_path / "trimmed"),
                 "--trim-vocab", *MIXED]) == 0
    assert _same_bits(_tensors(trained / "mixed" / "iter_0000002"),
                      _tensors(tmp_path / "trimmed" / "iter_0000002"))
    capsys.readouterr()


def test_a_megatron_padding_converts_both_ways_with_its_multiple(trained, tmp_path, capsys):
    """A Megatron-LM run padded its vocabulary 64 to a multiple of 128 x TP 2 = 256 rows (its
    padding rows nonzero): refused at these flags' 128, naming the multiple from its args;
    with --make-vocab-size-divisible-by 256 every row converts in, and back out, bit for bit."""
    source = _megatron_copy(trained / "mixed", tmp_path / "tp2", _padded_to(256))
    torch.save({"args": argparse.Namespace(make_vocab_size_divisible_by=128,
                                           tensor_model_parallel_size=2, padded_vocab_size=256)},
               source / "iter_0000002" / "common.pt")
    line = _refusal(capsys, tmp_path, source, MIXED)
    assert ("is [256, 32] there, [128, 32] for epoverlap's embedding (the vocabulary 64 padded "
            "to a multiple of --make-vocab-size-divisible-by 128); Megatron-LM padded it "
            "differently: give --make-vocab-size-divisible-by 256, or --trim-vocab keeps the "
            "first 128 rows") in line
    flags = MIXED + ["--make-vocab-size-divisible-by", "256"]
    assert main(["--from-megatron", str(source), "--out", str(tmp_path / "in"), *flags]) == 0
    assert main(["--to-megatron", str(tmp_path / "in"), "--out", str(tmp_path / "out")]) == 0
    theirs = _megatron_tensors(source / "iter_0000002")
    back = _megatron_tensors(tmp_path / "out" / "iter_0000002")
    assert theirs["output_layer.weight"].shape == (256, 32)
    assert _same_bits(theirs, back)
    common = read_common(tmp_path / "out" / "iter_0000002" / "common.pt")[0]
    assert (common["args"].padded_vocab_size, common["args"].make_vocab_size_divisible_by) \
        == (256, 256)
    capsys.readouterr()


def test_a_checkpoint_from_before_the_padding_converts_to_megatron(tmp_path, capsys):
    """An epoverlap checkpoint whose meta.json has no --make-vocab-size-divisible-by (written
    before the vocabulary was padded: 64 rows) converts as the unpadded model it is."""
    trainer = Trainer(parse_config(MOE + ["--train-iters", "1", "--save", str(tmp_path / "old"),
                                          "--make-vocab-size-divisible-by", "1"]),
                      single_rank_groups(), log=lambda msg: None)
    try:
        trainer.train()
    finally:
        trainer.close()
    meta_file = tmp_path / "old" / "iter_0000001" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["config"]["model"]["make_vocab_size_divisible_by"]
    meta_file.write_text(json.dumps(meta))
    assert main(["--to-megatron", str(tmp_path / "old"), "--out", str(tmp_path / "m")]) == 0
    back = _megatron_tensors(tmp_path / "m" / "iter_0000001")
    assert back["embedding.word_embeddings.weight"].shape == (VOCAB, 32)
    capsys.readouterr()


# --------------------------------------------------------------------------- megatron-core side
def _megatron_on_cpu():
    """Megatron-core 0.16.1 on a CPU-only torch: its layers ask for the current CUDA device,
    its token dispatcher makes a CUDA stream when built (never used here), its attention
    forks the CUDA random state around a dropout of 0 (the inference tracker's fork does
    nothing), its checkpoint writer synchronizes CUDA and logs memory through psutil (an
    install without deps may lack it)."""
    from benchmarks.harness import bench_peer
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args: None
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()
    bench_peer.bind_missing_te_names(moe_utils)
    if not filesystem_async.HAVE_PSUTIL:
        filesystem_async._process_memory = lambda: 0
    return bench_peer


def _seeded(model, ep_rank: int) -> None:
    """Every weight from a generator seeded by its global name (expert index global), so any
    EP size holds the same model; norm weights near 1, expert biases small."""
    local = {}
    for name, p in model.named_parameters():
        found = re.search(r"local_experts\.(\d+)\.", name)
        if found:
            local.setdefault(name.split("local_experts")[0], set()).add(int(found.group(1)))
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not (tensor.is_floating_point() and (name.endswith("weight")
                                                or name.endswith("expert_bias"))):
            continue
        found = re.search(r"local_experts\.(\d+)\.", name)
        if found:
            per_rank = len(local[name.split("local_experts")[0]])
            name = name.replace(found.group(0),
                                f"experts.{ep_rank * per_rank + int(found.group(1))}.")
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        values = torch.randn(tensor.shape, generator=gen)
        scale = (0.01 if name.endswith("expert_bias") else 0.3 if "router" in name else 0.1)
        with torch.no_grad():
            tensor.copy_(1.0 + 0.1 * values if "layernorm" in name else scale * values)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))


def _megatron_logits(model) -> torch.Tensor:
    tokens = _tokens()
    positions = torch.arange(16).expand(2, 16)
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(diagonal=1)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens, position_ids=positions, attention_mask=mask).float()


def _megatron_model(bench_peer, flags, ep: int, stacked: bool):
    import dataclasses
    cfg = parse_config(flags + ["--no-overlap-moe-expert-parallel-comm"]).with_vocab_size(VOCAB)
    # the all-gather dispatcher: the all-to-all one moves its counts through CUDA streams
    # (the dispatcher holds no weights; the checkpoint is the same)
    config = dataclasses.replace(bench_peer.megatron_config(cfg, ep),
                                 use_cpu_initialization=True,
                                 moe_token_dispatcher_type="allgather")
    if stacked:  # Megatron-LM's --moe-layer-freq 1 (an int): its stacked layout
        config = dataclasses.replace(config, moe_layer_freq=1)
    return bench_peer.megatron_model(config, cfg)


def megatron_side(rank, world_size, root, converted=None):
    """Megatron-core at EP = world_size: every model with seeded weights saved (Megatron-LM's
    folder layout, step 7; at EP 1 also the singleton layout), with its logits (EP 1).
    `converted`: {name: to-megatron folder} read into a fresh model each, -> whether every
    weight came back bitwise (and its logits, EP 1); None: converted here first (EP 1), both
    ways, by the command (it needs no megatron-core), into ROOT/epoverlap/NAME and
    ROOT/back/NAME."""
    import torch.distributed as dist
    bench_peer = _megatron_on_cpu()
    from megatron.core import dist_checkpointing, parallel_state
    dist.init_process_group("gloo")
    root = Path(root)
    results, models = {}, {}
    try:
        bench_peer.init_megatron(world_size)
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        for name, flags in CONFIGS.items():
            model = models[name] = _megatron_model(bench_peer, flags, world_size, name in STACKED)
            _seeded(model, ep_rank)
            folder = root / "saved" / f"{name}-ep{world_size}" / f"iter_{STEP:07d}"
            layouts = {folder: None}
            if name == "moe" and world_size == 1:
                layouts[root / "saved" / "moe-singleton"] = {"singleton_local_shards": True}
            for where, metadata in layouts.items():
                where.mkdir(parents=True, exist_ok=True)
                dist_checkpointing.save(model.sharded_state_dict(metadata=metadata), str(where))
            if rank == 0:
                (folder.parent / "latest_checkpointed_iteration.txt").write_text(f"{STEP}\n")
            results[name] = {"logits": _megatron_logits(model) if world_size == 1 else None}
        if converted is None:
            converted = _both_ways(root)
        for name, folder in converted.items():
            fresh = _megatron_model(bench_peer, CONFIGS[name], world_size, name in STACKED)
            # as Megatron-LM loads: the model's entries under "model", common.pt's beside them
            metadata = dist_checkpointing.load_content_metadata(folder)
            loaded = dist_checkpointing.load(
                {"model": fresh.sharded_state_dict(metadata=metadata)}, folder)
            fresh.load_state_dict(loaded["model"])
            results[name]["common"] = sorted(k for k in loaded if k != "model")
            results[name]["loaded_bitwise"] = all(
                torch.equal(a, b) for a, b in zip(models[name].state_dict().values(),
                                                  fresh.state_dict().values())
                if isinstance(a, torch.Tensor))
            results[name]["loaded_logits"] = (_megatron_logits(fresh) if world_size == 1
                                              else None)
        return results
    finally:
        bench_peer.destroy_megatron()
        dist.destroy_process_group()


def _both_ways(root: Path) -> dict:
    converted = {}
    for name, flags in CONFIGS.items():
        assert main(["--from-megatron", str(root / "saved" / f"{name}-ep1"),
                     "--out", str(root / "epoverlap" / name), *flags]) == 0
        assert main(["--to-megatron", str(root / "epoverlap" / name),
                     "--out", str(root / "back" / name)]) == 0
        converted[name] = str(root / "back" / name / f"iter_{STEP:07d}")
    return converted


def epoverlap_logits(flags, folder) -> tuple[torch.Tensor, int]:
    """The logits of the model `--load folder` gives (weights only), and the step it resumes
    after."""
    cfg = parse_config(flags).with_vocab_size(VOCAB)
    model, _, _ = one_process_model(cfg, "torch", torch.float32, "cpu")
    checkpointer = Checkpointer(cfg, single_rank_groups(), model,
                                MixedPrecisionAdamW(model, cfg.train), log=lambda msg: None)
    step = checkpointer.resume(find_resume_checkpoint(str(folder), None))
    tokens = _tokens()
    values = {"tokens": tokens, "labels": tokens, DROPOUT_SEED: None}
    model.eval()
    with torch.no_grad():
        for spec in model.node_specs():
            if spec.loss:
                hidden = values[spec.inputs["hidden"]]
                break
            out = spec.fn(**{local: values[name] for local, name in spec.inputs.items()})
            values.update({spec.outputs[local]: value for local, value in out.items()})
        logits = F.linear(model.final_norm(hidden), model.head)  # padding columns included
    return logits.view(*tokens.shape, PADDED), step


@pytest.fixture(scope="module")
def megatron_ep1(tmp_path_factory):
    """Megatron-core's saves and logits, the conversions both ways, and Megatron-core's load of
    the conversion back, in one spawned process."""
    root = tmp_path_factory.mktemp("mcore")
    return root, run_ranks(megatron_side, 1, str(root))[0]


@needs_megatron
@pytest.mark.parametrize("name", list(CONFIGS))
def test_epoverlap_gives_megatron_cores_logits(megatron_ep1, name):
    root, results = megatron_ep1
    logits, step = epoverlap_logits(CONFIGS[name], root / "epoverlap" / name)
    assert step == STEP
    theirs = results[name]["logits"]
    assert theirs.shape == logits.shape == (2, 16, PADDED)  # Megatron-LM's padding kept
    assert theirs.abs().max() > 0.5  # not a degenerate model
    torch.testing.assert_close(logits, theirs, rtol=1e-5, atol=1e-5)


@needs_megatron
@pytest.mark.parametrize("name", list(CONFIGS))
def test_megatron_core_loads_the_conversion_back_bitwise(megatron_ep1, name):
    _, results = megatron_ep1
    assert results[name]["loaded_bitwise"]
    assert torch.equal(results[name]["loaded_logits"], results[name]["logits"])


@needs_megatron
def test_every_megatron_layout_converts_to_the_same_bits(megatron_ep1, tmp_path):
    root, _ = megatron_ep1
    assert main(["--from-megatron", str(root / "saved" / "moe-singleton"),
                 "--out", str(tmp_path), "--step", str(STEP), *MOE]) == 0
    assert _same_bits(_tensors(root / "epoverlap" / "moe" / f"iter_{STEP:07d}"),
                      _tensors(tmp_path / f"iter_{STEP:07d}"))


@needs_megatron
def test_training_resumes_from_the_conversion(megatron_ep1):
    root, _ = megatron_ep1
    folder = root / "epoverlap" / "mixed"
    logs: list[str] = []
    trainer = Trainer(parse_config(MIXED + ["--train-iters", str(STEP + 1), "--load",
                                            str(folder)]),
                      single_rank_groups(), log=logs.append,
                      resume=find_resume_checkpoint(str(folder), None))
    try:
        assert trainer.start_step == STEP
        assert not any(trainer.parts.optimizer.state_of(m) for m in trainer.parts.optimizer.masters)
        results = trainer.train()
        assert [r.step for r in results] == [STEP + 1] and results[0].loss < 10
    finally:
        trainer.close()
    assert any(f"resuming from {folder / f'iter_{STEP:07d}'} at step {STEP}" in line
               for line in logs)


@needs_megatron
@pytest.mark.slow
def test_expert_parallel_saves_convert_alike(megatron_ep1, tmp_path):
    """The same weights saved at EP 2 convert to the EP 1 save's bits; EP 2 loads the
    conversion back bitwise."""
    root, _ = megatron_ep1
    converted = {name: str(root / "back" / name / f"iter_{STEP:07d}") for name in CONFIGS}
    results = run_ranks(megatron_side, 2, str(tmp_path), converted)
    for name, flags in CONFIGS.items():
        assert all(r[name]["loaded_bitwise"] for r in results)
        assert main(["--from-megatron", str(tmp_path / "saved" / f"{name}-ep2"),
                     "--out", str(tmp_path / name), *flags]) == 0
        assert _same_bits(_tensors(root / "epoverlap" / name / f"iter_{STEP:07d}"),
                          _tensors(tmp_path / name / f"iter_{STEP:07d}"))
