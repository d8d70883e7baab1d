"""Evaluation (--eval-interval N --eval-iters K, `training.loop.evaluate`): it changes no bit of
training (losses, grad norms and the router's force-balancing generator, on 2 gloo ranks at
EP 2 with and without the overlap, and in one process), it reports each evaluation (line, JSON
fields), a budget dispatch that overflows is rerun and gives the dropless validation loss, a
resumed run evaluates what the uninterrupted one does, the model is in eval mode without
autograd, K = 0 evaluates nothing, and the validation data is other data: the --split valid
documents of --data-path in the training mapping, or another --mock-data stream of the same
chain."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint_workers import FLAGS
from dist_helpers import run_ranks, single_rank_groups
from epoverlap.config import parse_config, validate_config
from epoverlap.data.indexed import IndexedWriter
from epoverlap.errors import ConfigError
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.training.checkpoints.checkpoint_files import iter_name, read_checkpoint
from epoverlap.training.setup.data import (IndexedData, SyntheticData, open_data_source,
                                           step_batches)
from epoverlap.training.loop.build import router_generators
from epoverlap.training.loop.trainer import Trainer

# FLAGS: the tiny model with the router's force-balancing generator and expert bias (state a
# forward touches or a step updates), 4 steps
EVAL = ["--eval-interval", "2", "--eval-iters", "2"]
OVERLAP = ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
TINY_BUDGET = ["--moe-dispatch-budget", "0.25"]  # a quarter of the balanced share: overflows
LINE = re.compile(r"^validation at step (\d+) \| loss (\d+\.\d{4}) \| ppl (\d+\.\d\d) \| "
                  r"\d+\.\d s$")


def train(groups, argv: list[str], log_json: Path, resume=None, lines=None) -> dict:
    """One run: its steps' records (this rank's), each evaluation's result, the generators'
    final states and the --log-json records (the first rank writes them)."""
    trainer = Trainer(parse_config(argv + ["--log-json", str(log_json)]), groups,
                      log=(lines.append if lines is not None else lambda msg: None),
                      resume=resume)
    evaluations, run = [], trainer.evaluator.run
    trainer.evaluator.run = lambda step: evaluations.append(run(step)) or evaluations[-1]
    try:
        records = [r.to_json() for r in trainer.train()]
        rng = [g.get_state() for g in router_generators(trainer.model)]
    finally:
        trainer.close()
    for evaluation in evaluations:
        next(r for r in records if r["step"] == evaluation.step).update(evaluation.record())
    logged = ([json.loads(line) for line in log_json.read_text().splitlines()]
              if groups.is_first() else None)
    return {"records": records, "evaluations": evaluations, "rng": rng, "json": logged}


def _bits(run: dict, *fields) -> list:
    return [[record.get(field) for field in fields] for record in run["records"]]


TRAINING = ("step", "loss_hex", "grad_norm_hex", "lr")


# ------------------------------------------------------------------------------ 2 gloo ranks
RUNS = {"plain": [], "eval": EVAL, "eval_overlap": EVAL + OVERLAP,
        "eval_tiny_budget": EVAL + TINY_BUDGET}


def two_rank_runs(rank, world_size, out_dir):
    groups = init_distributed(2, "cpu", timeout_minutes=3)
    try:
        return {name: train(groups, FLAGS + ["--expert-model-parallel-size", "2"] + flags,
                            Path(out_dir) / f"{name}-{rank}.jsonl")
                for name, flags in RUNS.items()}
    finally:
        destroy_distributed(groups)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(two_rank_runs, 2, str(tmp_path_factory.mktemp("eval")), timeout_s=400)


def test_evaluation_changes_no_bit_of_training_on_two_ranks(two_ranks):
    for runs in two_ranks:
        plain = _bits(runs["plain"], *TRAINING)
        for name in ("eval", "eval_overlap", "eval_tiny_budget"):
            assert _bits(runs[name], *TRAINING) == plain, name
            assert all(torch.equal(a, b) for a, b in zip(runs[name]["rng"],
                                                         runs["plain"]["rng"])), name
        assert runs["plain"]["rng"]  # the force-balancing generators are there


def test_every_rank_evaluates_the_same_batches_to_one_mean(two_ranks):
    valid = [_bits(runs["eval"], "step", "valid_loss_hex") for runs in two_ranks]
    assert valid[0] == valid[1]
    assert [step for step, hex_ in valid[0] if hex_ is not None] == [2, 4]
    losses = [e.loss for e in two_ranks[0]["eval"]["evaluations"]]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and losses[0] != losses[1]


def test_an_overflowing_budget_is_rerun_and_gives_the_dropless_validation_loss(two_ranks):
    for runs in two_ranks:
        budget, dropless = runs["eval_tiny_budget"]["evaluations"], runs["eval"]["evaluations"]
        assert all(e.reruns >= 1 for e in budget)  # at least one batch overflowed, each time
        assert all(e.reruns == 0 for e in dropless)
        assert [e.loss.hex() for e in budget] == [e.loss.hex() for e in dropless]
        overlapped = runs["eval_overlap"]["evaluations"]
        assert [e.loss.hex() for e in overlapped] == [e.loss.hex() for e in dropless]


# ------------------------------------------------------------------------------ one process
def test_one_process_reports_each_evaluation_and_changes_no_training_bit(tmp_path, one_thread):
    argv = FLAGS + ["--train-iters", "5", "--log-interval", "1"]
    plain = train(single_rank_groups(), argv, tmp_path / "plain.jsonl")
    lines: list[str] = []
    evaluated = train(single_rank_groups(), argv + EVAL, tmp_path / "eval.jsonl", lines=lines)
    assert _bits(evaluated, *TRAINING) == _bits(plain, *TRAINING)
    assert evaluated["json"] == evaluated["records"]  # what --log-json holds
    records = {r["step"]: r for r in evaluated["json"]}
    assert [s for s, r in records.items() if "valid_loss" in r] == [2, 4, 5]  # and the last
    shown = [LINE.match(line) for line in lines if line.startswith("validation")]
    assert [int(m.group(1)) for m in shown] == [2, 4, 5]
    for match in shown:
        record = records[int(match.group(1))]
        assert record["valid_loss_hex"] == float.hex(record["valid_loss"])
        assert match.group(2) == f"{record['valid_loss']:.4f}"
        assert record["valid_ppl"] == pytest.approx(math.exp(record["valid_loss"]))
    step_4 = lines.index(next(line for line in lines if line.startswith("step    4/5")))
    assert lines[step_4 + 1].startswith("validation at step 4 |")  # right after its step


def test_eval_iters_0_evaluates_nothing(tmp_path, one_thread):
    argv = FLAGS + ["--train-iters", "2", "--eval-interval", "1", "--eval-iters", "0"]
    trainer = Trainer(parse_config(argv), single_rank_groups(), log=lambda msg: None)
    try:
        assert trainer.evaluator.data is None and not trainer.evaluator.due(1)
    finally:
        trainer.close()


def test_the_forward_is_in_eval_mode_without_autograd_and_the_mode_comes_back(one_thread):
    argv = FLAGS + ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "3"]
    trainer = Trainer(parse_config(argv), single_rank_groups(), log=lambda msg: None)
    seen, stage_forward = [], trainer.model.stage_forward

    def watched(*args, **kwargs):
        seen.append((trainer.model.training, torch.is_grad_enabled()))
        return stage_forward(*args, **kwargs)
    trainer.model.stage_forward = watched
    try:
        trainer.train()
        assert trainer.model.training
    finally:
        trainer.close()
    # the training steps run through the executor; the evaluation forward is the stage's
    assert seen == [(False, False)] * 3 * 4  # 3 batches x 4 microbatches


def test_dropout_is_off_in_evaluation_and_training_keeps_its_bits(tmp_path, one_thread):
    """With dropout the evaluation forward has no dropout seed: it runs because the model is
    in eval mode (a training forward would refuse), gives the same loss twice, and the
    training steps around it keep their bits."""
    argv = FLAGS + ["--train-iters", "3", "--hidden-dropout", "0.2", "--attention-dropout",
                    "0.2"]
    plain = train(single_rank_groups(), argv, tmp_path / "plain.jsonl")
    evaluated = train(single_rank_groups(), argv + ["--eval-interval", "1", "--eval-iters",
                                                    "1"], tmp_path / "eval.jsonl")
    assert _bits(evaluated, *TRAINING) == _bits(plain, *TRAINING)
    trainer = Trainer(parse_config(argv + EVAL), single_rank_groups(), log=lambda msg: None)
    try:
        assert trainer.evaluator.run(2).loss == trainer.evaluator.run(2).loss
    finally:
        trainer.close()


def test_a_resumed_run_evaluates_what_the_uninterrupted_one_does(tmp_path, one_thread):
    """Steps 1-4, saved at 2; resumed at 2: the same validation loss at step 4 (the same
    batches: evaluation 2 of the run, and the same weights), and the step lines count the
    steps left to --train-iters."""
    argv = FLAGS + EVAL + ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    whole = train(single_rank_groups(), argv, tmp_path / "whole.jsonl")
    saved = tmp_path / "ckpt" / iter_name(2)
    lines: list[str] = []
    resumed = train(single_rank_groups(), FLAGS + EVAL + ["--log-interval", "1"],
                    tmp_path / "resumed.jsonl", resume=read_checkpoint(saved, str(saved)),
                    lines=lines)
    assert [e.step for e in resumed["evaluations"]] == [4]
    assert resumed["evaluations"][0].loss.hex() == whole["evaluations"][1].loss.hex()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line[:9] for line in steps] == ["step    3", "step    4"]
    assert " | ETA " in steps[0] and " | ETA " not in steps[1]  # step 4/4: none left


# ------------------------------------------------------------------------------ the data
def test_mock_validation_is_the_same_chain_with_other_batches():
    train_data = SyntheticData(64, seed=5)
    valid = train_data.validation_stream()
    assert valid.next_tokens is train_data.next_tokens  # the same distribution
    fresh = SyntheticData(64, seed=5)
    for step in (1, 2, 3):
        for rank in (0, 1):
            ours = step_batches(train_data, step, rank, 2, 2, 16)
            for (tokens, _), (again, _) in zip(ours, step_batches(fresh, step, rank, 2, 2, 16)):
                assert torch.equal(tokens, again)  # the training stream is untouched
    seen = {tuple(row.tolist()) for step in range(1, 9) for rank in (0, 1)
            for tokens, _ in step_batches(fresh, step, rank, 4, 2, 16) for row in tokens}
    drawn = {tuple(row.tolist()) for index in range(1, 9) for rank in (0, 1)
             for tokens, _ in step_batches(valid, index, rank, 4, 2, 16) for row in tokens}
    assert not seen & drawn


SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
         "--num-experts", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--num-microbatches", "2", "--train-iters", "5", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "1000"]


def _documents(prefix: Path, count: int = 100) -> str:
    """Document i: 40 tokens, each i (so a token names its document)."""
    with IndexedWriter(str(prefix), np.uint16) as writer:
        for doc in range(count):
            writer.add_document(np.full(40, doc))
    return str(prefix)


def _open(argv: list[str], world: int = 2):
    cfg = parse_config(SMALL + argv)
    validate_config(cfg, world, False)
    return open_data_source(cfg, world)


def test_indexed_validation_reads_the_valid_documents_in_the_training_mapping(tmp_path):
    prefix = _documents(tmp_path / "d")
    data = _open(["--data-path", prefix, "--split", "80,20,0", "--eval-interval", "2",
                  "--eval-iters", "3"])
    valid = data.validation
    assert isinstance(valid, IndexedData)
    # evaluations at steps 2, 4, 5: 3 x 3 global batches of 2 microbatches x 2 ranks x 2
    assert valid.samples.total_samples == 3 * 3 * 2 * 2 * 2
    assert "valid tokens" in valid.description
    for index in (1, 9):
        for rank in (0, 1):
            for mb in (0, 1):
                tokens, labels = valid.batch(index, rank, mb, 2, 16)
                first = (((index - 1) * 2 + mb) * 2 + rank) * 2
                for b in range(2):
                    window = valid.samples.sample(first + b)
                    assert tokens[b].tolist() == window[:-1].tolist()
                    assert labels[b].tolist() == window[1:].tolist()
                assert 80 <= int(tokens.min()) and int(tokens.max()) < 100
                train_tokens = data.batch(index % 5 + 1, rank, mb, 2, 16)[0]
                assert int(train_tokens.max()) < 80
    assert not hasattr(_open(["--data-path", prefix, "--split", "80,20,0"]), "validation")


def test_a_valid_split_too_short_is_refused_naming_the_dataset(tmp_path):
    prefix = _documents(tmp_path / "d")
    with pytest.raises(ConfigError, match=r"its valid split \(documents \[100, 100\)"):
        _open(["--data-path", prefix, "--split", "100,0.001,0", "--eval-interval", "2"])


# ------------------------------------------------------------------------------ pipeline stages
PIPELINE = EVAL + ["--num-layers", "2", "--expert-model-parallel-size", "1"]


def pipeline_run(rank, world_size, out_dir):
    groups = init_distributed(1, "cpu", timeout_minutes=3, pp_size=2)
    try:
        return train(groups, FLAGS + PIPELINE + ["--pipeline-model-parallel-size", "2"],
                     Path(out_dir) / f"pp-{rank}.jsonl")
    finally:
        destroy_distributed(groups)


def test_pipeline_stages_evaluate_the_one_stage_model_s_validation_loss(tmp_path, one_thread):
    """PP 2 on 2 gloo ranks (one layer a stage): every stage reports the validation loss the
    same model on one stage gets, at the same steps (the stage holding the head computes it)."""
    staged = run_ranks(pipeline_run, 2, str(tmp_path), timeout_s=400)
    whole = train(single_rank_groups(), FLAGS + PIPELINE, tmp_path / "one.jsonl")
    expected = [(e.step, e.loss) for e in whole["evaluations"]]
    assert [step for step, _ in expected] == [2, 4]
    for run in staged:
        assert [e.step for e in run["evaluations"]] == [2, 4]
        for (step, loss), mine in zip(expected, run["evaluations"]):
            assert math.isclose(mine.loss, loss, rel_tol=1e-6), (step, mine.loss, loss)
