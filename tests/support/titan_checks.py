"""Checks of torchtitan d84e83dc4 from the carry, for tests/benchmarks/test_peer_titan_1gpu.py.

    python tests/support/titan_checks.py CHECK   (prints one JSON object)

Run in a process of its own whose PYTHONPATH is `peer_titan_1gpu.titan_env`'s (the carry's
source first), so that another torchtitan installed here is never imported beside it.
CHECK is one of: imports, configs, counts, forward, loader, or every (each by name); or
`trainer SHAPE`, which prints torchtitan's own log of 3 training steps instead."""

from __future__ import annotations

import json
import math
import sys

import torch

# the model's structure kept, its sizes small: GQA, shared experts and dense layers as the
# presets have them
SMALL = ["--hidden-size", "64", "--ffn-hidden-size", "96", "--moe-ffn-hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "32",
         "--vocab-size", "300"]
SHARED_SMALL = ["--moe-shared-expert-intermediate-size", "64"]


def _small_config(shape: str):
    from epoverlap.config import parse_config
    from benchmarks.harness.peer_titan_1gpu import PEER_FLAGS, SHAPES
    preset = SHAPES[shape].preset
    flags = ["--preset", preset, *PEER_FLAGS, *SMALL]
    if parse_config(["--preset", preset]).moe.moe_shared_expert_intermediate_size:
        flags += SHARED_SMALL
    return parse_config(flags)


def _titan_config(cfg, device: str):
    """torchtitan's model config of `cfg`; on the CPU with its experts' for-loop path (its
    grouped path permutes tokens with a Triton kernel)."""
    from benchmarks.harness.titan_shapes import model_config
    config = model_config(cfg, cfg.data.vocab_size)
    config.layer.moe.experts.use_grouped_mm = device != "cpu"
    return config


def _titan_model(cfg, device: str):
    with torch.device(device):
        return _titan_config(cfg, device).build()


def imports() -> dict:
    import torchtitan
    import torchtitan.train  # noqa: F401 (the entry the runner starts)
    return {"file": torchtitan.__file__, "torch": torch.__version__}


def configs() -> dict:
    """Each config through torchtitan's own ConfigManager with the runner's flags."""
    from torchtitan.config import ConfigManager
    from benchmarks.harness.peer_titan_1gpu import SHAPES, titan_command
    found = {}
    for shape in SHAPES:
        argv = titan_command(shape, "compiled", 7, "/tmp/titan-dump")
        c = ConfigManager().parse_args(argv[argv.index("torchtitan.train") + 1:])
        model = c.model_spec.model
        found[shape] = {"steps": c.training.steps, "compile": c.compile.enable,
                        "balanced": c.debug.moe_force_load_balance,
                        "router_balanced": model.layer.moe.router._debug_force_load_balance,
                        "ac": c.activation_checkpoint.mode,
                        "loader": type(c.dataloader).__qualname__,
                        "loader_vocab": c.dataloader.vocab_size, "vocab": model.vocab_size,
                        "local_batch": c.training.local_batch_size, "seq": c.training.seq_len,
                        "dense_layers": model.layer.n_dense_layers,
                        "tokenizer": c.hf_assets_path}
    return found


def counts() -> dict:
    """Parameters of each shape at small sizes: torchtitan's model (on meta) against
    epoverlap's (on the CPU), in all and in the routed and shared experts."""
    from dist_helpers import one_process_model
    from epoverlap.model.transformer import count_parameters
    found = {}
    for shape in ("qwen3", "mixtral", "dsv3"):
        cfg = _small_config(shape)
        titan = _titan_model(cfg, "meta")
        ours = one_process_model(cfg.with_vocab_size(cfg.data.vocab_size + 1), "torch",
                                 torch.float32, "cpu")[0]
        theirs = dict(titan.named_parameters())
        found[shape] = {
            "titan": sum(p.numel() for p in theirs.values()),
            "ours": sum(count_parameters(ours, 1)[k] for k in ("dense", "expert_local")),
            "hidden": cfg.model.hidden_size,
            "titan_routed": sum(p.numel() for n, p in theirs.items() if ".moe.experts." in n),
            "ours_routed": count_parameters(ours, 1)["expert_local"],
            "titan_shared": sum(p.numel() for n, p in theirs.items() if "shared_experts" in n),
            "ours_shared": sum(p.numel() for n, p in ours.named_parameters() if "shared" in n),
            "titan_moe_layers": [bool(b.moe_enabled) for b in titan.layers.values()],
            "ours_moe_layers": cfg.moe_layer_pattern()}
    return found


def forward() -> dict:
    """One forward and backward of each shape's small torchtitan model on the CPU (routing
    forced to balance): the logits' shape, the loss at init against ln V, every gradient. The
    router counts tokens per expert with torch.histc of int64 expert ids, which only CUDA
    implements: here the ids are counted as floats (the same counts)."""
    histc = torch.histc
    torch.histc = lambda ids, *args, **kw: histc(ids.float(), *args, **kw).to(ids.dtype)
    found = {}
    for shape in ("qwen3", "mixtral", "dsv3"):
        cfg = _small_config(shape)
        model = _titan_model(cfg, "cpu")
        model.init_weights(buffer_device=torch.device("cpu"))
        vocab, seq = cfg.data.vocab_size, cfg.model.seq_length
        tokens = torch.randint(0, vocab, (2, seq + 1), generator=torch.Generator().manual_seed(0))
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        found[shape] = {"logits": list(logits.shape), "loss": loss.item(),
                        "ln_vocab": math.log(vocab),
                        "all_grads": all(g is not None and bool(torch.isfinite(g).all())
                                         for g in grads)}
    return found


def loader() -> dict:
    from benchmarks.harness.titan_shapes import RandomTokens
    built = RandomTokens.Config(vocab_size=300, seed=3).build(
        dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=16, local_batch_size=2)
    stream = iter(built)
    (first, labels), (second, _) = next(stream), next(stream)
    again, _ = next(iter(RandomTokens.Config(vocab_size=300, seed=3).build(
        dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=16, local_batch_size=2)))
    ids = first["input"]
    return {"input": list(ids.shape), "labels": list(labels.shape),
            "shifted": bool(torch.equal(ids[:, 1:], labels[:, :-1])),
            "low": int(ids.min()), "high": int(torch.cat([ids, labels], 1).max()),
            "seeded": bool(torch.equal(again["input"], ids)),
            "fresh": not torch.equal(second["input"], ids),
            "state": built.state_dict()}


def _on_the_cpu() -> None:
    """What torchtitan's Trainer needs from a GPU, stood in for on the CPU: the device type
    (torch's, read by torchtitan at import), its memory monitor (CUDA's allocator stats), the
    process groups' barrier after step 1 (CUDA device ids) and histc of int64 expert ids."""
    import torch._utils
    torch._utils._get_available_device_type = lambda: "cpu"
    histc = torch.histc
    torch.histc = lambda ids, *args, **kw: histc(ids.float(), *args, **kw).to(ids.dtype)
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils

    class Monitor:
        device_name, device_capacity_gib = "cpu", 1.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0.5, 50.0, 0.5, 50.0, 0, 0)

        def reset_peak_stats(self):
            pass

    metrics.build_device_memory_monitor = Monitor
    dist_utils.set_pg_timeouts = lambda **kwargs: None


def trainer(shape: str) -> None:
    """torchtitan's Trainer, from the runner's own command line through its ConfigManager, at
    `shape`'s small sizes, 3 steps on one gloo process: its experts' for-loop path, foreach
    AdamW (the GPU runs take its defaults: grouped GEMMs, fused AdamW)."""
    import os
    _on_the_cpu()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29531"))
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from benchmarks.harness.peer_titan_1gpu import titan_command
    init_logger()
    argv = titan_command(shape, "eager", 3, os.environ.get("DUMP", "/tmp/titan-dump"))
    config = ConfigManager().parse_args(argv[argv.index("torchtitan.train") + 1:]
                                        + ["--optimizer.implementation", "foreach"])
    cfg = _small_config(shape)
    config.model_spec.model = _titan_config(cfg, "cpu")
    config.dataloader.vocab_size, config.training.seq_len = (cfg.data.vocab_size,
                                                             cfg.model.seq_length)
    built = config.build()
    built.train()
    built.close()
    torch.distributed.destroy_process_group()


CHECKS = (imports, configs, counts, forward, loader)


def every() -> dict:
    return {check.__name__: check() for check in CHECKS}


if __name__ == "__main__":
    if sys.argv[1] == "trainer":
        trainer(sys.argv[2])
    else:
        print(json.dumps(globals()[sys.argv[1]]()))
