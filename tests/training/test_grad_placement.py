"""Where the weight grads land, on the path users take (`training.loop.build`):

- the norms' and the embedding's weight grads go into their fp32 main grads inside their ops'
  backward (`model.linear.fused_main_grad`), so no parameter's grad is added by the grad
  buffers' hook on the default path, and --no-gradient-accumulation-fusion keeps the hook's add
  for exactly those parameters, once a microbatch;
- training with that placement and without it (the hook path) gives the same bits of every
  loss, grad norm and weight, on both kernel backends (the Triton one interpreted here), with
  the expert grads left unzeroed (NaN) before each step as the step's first write must
  overwrite them;
- the experts' weight grads are paired over microbatches only where the memory estimate with
  the paired rows leaves PAIRING_HEADROOM of a rank's budget free (`setup.memory.
  place_expert_grads`, under a fake capacity here), the run says which at start-up, and a run
  is refused only when the unpaired estimate does not fit.
"""

from __future__ import annotations

import math

import pytest
import torch

from dist_helpers import single_rank_groups
from grad_poison import poison_unzeroed_expert_grads
from epoverlap.config import parse_config, resolve_config
from epoverlap.errors import ConfigError
from epoverlap.model import attention, transformer
from epoverlap.schedule.wgrad import WeightGradQueue
from epoverlap.training.loop import build
from epoverlap.training.loop.trainer import Trainer
from epoverlap.training.optimizer import grads
from epoverlap.training.setup import memory

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "48", "--moe-ffn-hidden-size", "24",
         "--num-experts", "4", "--moe-router-topk", "2", "--seq-length", "16",
         "--micro-batch-size", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "127", "--device", "cpu", "--train-iters", "3"]


@pytest.fixture
def hook_adds(monkeypatch) -> list:
    """The parameters (names' stand-in: shapes) whose grad the grad buffers' hook added."""
    added: list = []
    fold = grads._fold_into_main_grad

    def counting(param):
        if param.grad is not None:
            added.append(tuple(param.shape))
        fold(param)
    monkeypatch.setattr(grads, "_fold_into_main_grad", counting)
    return added


def _train(flags: list[str], log=lambda line: None) -> tuple[list, dict]:
    trainer = Trainer(parse_config(FLAGS + flags), single_rank_groups(), log=log)
    try:
        results = [(r.loss.hex(), r.grad_norm.hex()) for r in trainer.train()]
        params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
    return results, params


def _hook_path(monkeypatch) -> None:
    """The norms and the embedding as before: autograd's grad, added by the hook."""
    for module in (attention, transformer):
        monkeypatch.setattr(module, "fused_main_grad", lambda param: None)


def test_no_parameter_adds_its_grad_per_microbatch(hook_adds):
    _train(["--num-microbatches", "2"])
    assert hook_adds == []
    _train(["--num-microbatches", "2", "--no-gradient-accumulation-fusion"])
    norms_and_embedding = 2 * 2 + 1 + 1  # two norms a layer, the final norm, the embedding
    assert len(hook_adds) == norms_and_embedding * 2 * 3  # once a microbatch, 2 x 3 steps
    assert (128, 32) in hook_adds and (32,) in hook_adds  # padded vocabulary x hidden, a norm


@pytest.mark.parametrize("backend,flags", [
    ("torch", ["--num-microbatches", "3", "--overlap-moe-expert-parallel-comm",
               "--delay-wgrad-compute"]),
    ("torch", ["--num-microbatches", "2", "--qk-layernorm"]),
    ("triton", ["--num-microbatches", "3", "--overlap-moe-expert-parallel-comm",
                "--delay-wgrad-compute"]),
])
def test_fused_and_hooked_grads_train_to_the_same_bits(backend, flags, monkeypatch, hook_adds):
    poison_unzeroed_expert_grads(monkeypatch)
    flags = flags + ["--kernel-backend", backend]
    fused, fused_params = _train(flags)
    assert hook_adds == []
    _hook_path(monkeypatch)
    hooked, hooked_params = _train(flags)
    assert hook_adds  # the other side took the hook
    assert all(math.isfinite(float.fromhex(loss)) for loss, _ in fused)
    assert fused == hooked
    for name, value in hooked_params.items():
        assert torch.equal(fused_params[name], value), name


# ------------------------------------------------------------------ pairing under the budget

def _cfg(*extra: str):
    return resolve_config(parse_config(FLAGS + ["--num-microbatches", "2", *extra]), 1, False)


def test_pairing_only_where_the_estimate_leaves_the_headroom():
    cfg = _cfg()
    paired = memory.estimate_memory(cfg, 1, paired=True).total
    assert paired > memory.estimate_memory(cfg, 1, paired=False).total
    fits = math.ceil(paired / (1 - memory.PAIRING_HEADROOM))
    placed = memory.place_expert_grads(cfg, 1, fits, "a fake GPU")
    assert placed.pair_microbatches and placed.first_write
    assert "2k and 2k+1 paired" in placed.line and "a fake GPU" in placed.line
    for budget in (fits - 64, paired, None):  # under the headroom, or nothing known
        placed = memory.place_expert_grads(cfg, 1, budget, "a fake GPU")
        assert not placed.pair_microbatches and placed.first_write, budget
        assert "one launch a microbatch" in placed.line
    unfused = memory.place_expert_grads(_cfg("--no-gradient-accumulation-fusion"), 1, 2 ** 50,
                                        "a fake GPU")
    assert not unfused.pair_microbatches and not unfused.first_write


@pytest.mark.parametrize("room,paired", [(0.5, False), (4.0, True)])
def test_a_run_pairs_as_its_budget_allows_and_says_so(room, paired, monkeypatch):
    """The trainer's queue takes the decision under the (fake) capacity and logs it; either way
    the step trains."""
    needs = memory.estimate_memory(_cfg(), 1, paired=True).total
    monkeypatch.setattr(build, "available_memory",
                        lambda *args: (int(needs * room), "a fake capacity"))
    pairs = []
    expert_grad = WeightGradQueue.expert_grad
    monkeypatch.setattr(WeightGradQueue, "expert_grad", lambda self, p, part, rows, run: (
        expert_grad(self, p, part, rows, lambda sources, accumulate: (
            pairs.append(len(sources)), run(sources, accumulate)))))
    lines: list[str] = []
    results, _ = _train(["--num-microbatches", "2", "--train-iters", "1"], log=lines.append)
    placement = [line for line in lines if line.startswith("expert weight grads:")]
    assert len(placement) == 1 and "a fake capacity" in placement[0]
    assert ("2k and 2k+1 paired" in placement[0]) == paired
    assert set(pairs) == ({2} if paired else {1}) and len(results) == 1


def test_the_memory_check_refuses_only_what_does_not_fit_unpaired(monkeypatch):
    cfg = _cfg()
    unpaired = memory.estimate_memory(cfg, 1, paired=False).total
    paired = memory.estimate_memory(cfg, 1, paired=True).total
    between = (unpaired + paired) // 2
    monkeypatch.setattr(memory, "available_memory", lambda *args: (between, "a fake host"))
    memory.check_memory(cfg, 1, "cpu", 1)  # fits without the pairing: the run does without
    monkeypatch.setattr(memory, "available_memory", lambda *args: (unpaired - 1, "a fake host"))
    with pytest.raises(ConfigError):
        memory.check_memory(cfg, 1, "cpu", 1)


# ------------------------------------------------------------------ GPU

GPU_FLAGS = ["--preset", "tiny", "--bf16", "--train-iters", "6", "--kernel-backend", "triton",
             "--seq-length", "1024", "--micro-batch-size", "4", "--num-microbatches", "2",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
             "--moe-dispatch-budget", "0.5"]


def _gpu_train(flags: list[str]) -> tuple[list, list]:
    """Losses and grad norms (hex) and every weight after `flags` on this GPU, in process
    (deterministic algorithms on, as --deterministic-mode sets them)."""
    from unittest import mock

    from epoverlap.parallel.groups import destroy_distributed, init_distributed

    torch.use_deterministic_algorithms(True)
    try:
        with mock.patch.dict("os.environ"):  # init_distributed sets RANK, MASTER_PORT, ...
            groups = init_distributed(1, "cuda")
            try:
                trainer = Trainer(parse_config(GPU_FLAGS + flags), groups, log=lambda m: None)
                try:
                    results = [(r.loss.hex(), r.grad_norm.hex()) for r in trainer.train()]
                    weights = [p.detach().cpu() for p in trainer.model.parameters()]
                finally:
                    trainer.close()
            finally:
                destroy_distributed(groups)
    finally:
        torch.use_deterministic_algorithms(False)
    return results, weights


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_grads_into_the_main_grad_repeat_replay_and_keep_the_unfused_bits(monkeypatch):
    """4096 tokens a microbatch (above 3072: torch's CUDA embedding backward sorts, the
    fused kernel's order): the default placement twice, under one CUDA graph of the whole
    iteration (the embedding's sort and kernel and every norm's captured), and the hook path
    (autograd's grads added after the backward) give the same bits, bf16, Triton kernels."""
    eager = _gpu_train(["--cuda-graph-impl", "none"])
    assert all(math.isfinite(float.fromhex(loss)) for loss, _ in eager[0])
    assert _same(eager, _gpu_train(["--cuda-graph-impl", "none"]))
    assert _same(eager, _gpu_train(["--cuda-graph-impl", "full_iteration"]))
    _hook_path(monkeypatch)
    assert _same(eager, _gpu_train(["--cuda-graph-impl", "none"]))
