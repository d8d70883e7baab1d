"""The experts' fused weight grads paired over microbatches and written first (`schedule.wgrad`,
`WeightGradQueue.expert_grad`; `training.setup.memory.place_expert_grads`): the queue's rules,
and training runs on the CPU with the placement on (the default) and off giving the same bits of
every loss, grad norm and weight, with the expert grads left unzeroed (NaN) before each step under
the placement, so a first weight grad that added to them instead of overwriting shows.
"""

from __future__ import annotations

import pytest
import torch

from dist_helpers import single_rank_groups
from grad_poison import poison_unzeroed_expert_grads
from epoverlap.config import parse_config
from epoverlap.schedule.wgrad import WeightGradQueue
from epoverlap.training.loop import build
from epoverlap.training.setup import memory
from epoverlap.training.loop.trainer import Trainer

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "48", "--moe-ffn-hidden-size", "24",
         "--num-experts", "4", "--moe-router-topk", "2", "--seq-length", "16",
         "--micro-batch-size", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "127", "--device", "cpu", "--train-iters", "3"]


def _placed(queue: WeightGradQueue, microbatch: int, param="w", part=None) -> list:
    """Offer one microbatch's rows; -> the calls run: [(sources' microbatches, accumulate)]."""
    calls = []
    with queue.collecting((microbatch, 0, "moe")):
        queue.expert_grad(param, part, (microbatch,),
                          lambda sources, accumulate: calls.append(
                              ([s[0] for s in sources], accumulate)))
    return calls


def test_pairs_even_with_odd_microbatches_and_writes_first():
    queue = WeightGradQueue(first_write=True, pair_microbatches=True)
    queue.begin_run(3)
    assert _placed(queue, 0) == []  # waits for microbatch 1
    assert _placed(queue, 1) == [([0, 1], False)]  # one call, overwriting the main grad
    assert _placed(queue, 2) == [([2], True)]  # the odd one out runs alone, adding
    queue.check_paired()
    assert queue.written == {"w"}
    queue.begin_run(3)
    assert queue.written == set()


def test_without_placement_every_call_runs_alone_and_adds():
    queue = WeightGradQueue()
    queue.begin_run(2)
    assert _placed(queue, 0) == [([0], True)]
    assert _placed(queue, 1) == [([1], True)]


def test_a_microbatch_left_waiting_is_an_error():
    queue = WeightGradQueue(pair_microbatches=True)
    queue.begin_run(2)
    _placed(queue, 0)
    with pytest.raises(RuntimeError, match="never paired"):
        queue.check_paired()


def test_deferred_work_is_placed_by_its_own_microbatch():
    """A delayed weight grad runs under `run(key)`: its microbatch is the key's."""
    queue = WeightGradQueue(enabled=True, pair_microbatches=True)
    queue.begin_run(2)
    calls = []
    for microbatch in (0, 1):
        with queue.collecting((microbatch, 0, "moe")):
            assert queue.defer(lambda m=microbatch: queue.expert_grad(
                "w", None, (m,), lambda s, a: calls.append([x[0] for x in s])))
    queue.run((0, 0, "moe"))
    assert calls == []
    queue.run((1, 0, "moe"))
    assert calls == [[0, 1]]


def _train(flags: list[str]) -> tuple[list, dict]:
    trainer = Trainer(parse_config(FLAGS + flags), single_rank_groups(), log=lambda msg: None)
    try:
        queue, placed = trainer.parts.wgrad_queue, trainer.parts.expert_grads
        assert (queue.first_write, queue.pair_microbatches) == (placed.first_write,
                                                                placed.pair_microbatches)
        results = [(r.loss, r.grad_norm) for r in trainer.train()]
        params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
    return results, params


@pytest.mark.parametrize("flags", [
    ["--num-microbatches", "2"],
    ["--num-microbatches", "3", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"],
    ["--num-microbatches", "4", "--overlap-moe-expert-parallel-comm"],
])
def test_placement_on_and_off_train_to_the_same_bits(flags, monkeypatch):
    pairs = []
    expert_grad = WeightGradQueue.expert_grad

    def counting(self, param, part, rows, run):
        expert_grad(self, param, part, rows,
                    lambda sources, accumulate: (pairs.append(len(sources)),
                                                 run(sources, accumulate)))
    monkeypatch.setattr(WeightGradQueue, "expert_grad", counting)
    poison_unzeroed_expert_grads(monkeypatch)
    placed, placed_params = _train(flags)
    assert 2 in pairs  # microbatches were paired
    monkeypatch.setattr(build, "place_expert_grads", lambda *args: memory.ExpertGradPlacement(
        False, False, "off"))
    pairs.clear()
    plain, plain_params = _train(flags)
    assert pairs and set(pairs) == {1}
    assert [(a.hex(), b.hex()) for a, b in placed] == [(a.hex(), b.hex()) for a, b in plain]
    for name, value in plain_params.items():
        assert torch.equal(placed_params[name], value), name
