"""Checkpoints: bitwise resume with overlap and delayed wgrad (2 gloo ranks), resharding to other
EP and data-parallel sizes (state bitwise, losses within a stated tolerance), atomic saving
(a cut-off save is never loaded), one-line errors for missing, corrupt and incompatible
checkpoints, and the NaN check (the optimizer state is untouched by the failing step)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from checkpoint_workers import FLAGS, checkpoint_tensors, run, two_rank_suite
from dist_helpers import run_ranks, single_rank_groups
from epoverlap.config import parse_config
from epoverlap.errors import CheckpointError
from epoverlap.training.checkpoints import checkpoint_files as files
from epoverlap.training.checkpoints.checkpoint_files import find_resume_checkpoint, iter_name
from epoverlap.training.loop.trainer import Trainer
from epoverlap.cli.compare_losses import compare_loss_logs

# Measured (CPU, gloo, 2 ranks, fp32, TINY variants, 8 steps after a resume at step 2 written at
# EP 2): resumed at EP 1 the losses differ by at most 9.5e-8 relative, at most one step in 8
# differs at all, and often none (expert weight grads are summed in another order: float32
# rounding). The state itself reshards bitwise, and EP 2 -> 1 -> 2 resumes bitwise. The bound
# below leaves a margin of 100x.
EP_CHANGE_REL_TOL = 1e-5


FAULTS = {"nan-grad@3:1:layers.1.experts.fc2": "rank 1: NaN/Inf in the gradient of "
                                              "layers.1.experts.fc2 (first of 1 parameter(s))",
          "nan-loss@3:0": "rank 0: NaN/Inf in the loss of microbatch(es) [0, 1, 2, 3]"}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-rank gloo run of every multi-rank scenario here (see two_rank_suite)."""
    out = tmp_path_factory.mktemp("two_ranks")
    return out, run_ranks(two_rank_suite, 2, str(out), list(FAULTS), timeout_s=300)


@pytest.fixture
def layouts(two_ranks):
    out, results = two_ranks
    assert results[0]["losses"] == results[1]["losses"]  # the logged loss: a mean over ranks
    return out, results[0]["losses"]


def _same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_resume_is_bitwise_identical_with_overlap_and_delayed_wgrad(layouts):
    out, losses = layouts
    assert losses["R"] == losses["A"][2:]
    comparison = compare_loss_logs(out / "A.jsonl", out / "R.jsonl")  # log kept 1-2, added 3-4
    assert comparison.identical and comparison.steps_compared == 4, comparison.message
    assert comparison.grad_norms_compared == 4  # the resumed steps' grad norms too
    assert _same_tensors(checkpoint_tensors(out / "R" / iter_name(4)),
                         checkpoint_tensors(out / "A" / iter_name(4)))  # and the final state


@pytest.mark.slow
def test_resume_at_another_ep_size_reshards_the_state_bitwise(layouts):
    out, losses = layouts
    saved = checkpoint_tensors(out / "A" / iter_name(2))
    assert any("/expert/3" in key for key in saved) and any("optim/" in k for k in saved)
    for layout in ("B", "D"):  # EP 2 -> 1, then EP 1 -> 2: every key, moments included
        assert _same_tensors(checkpoint_tensors(out / layout / iter_name(2)), saved), layout
    assert losses["D"] == losses["A"][2:]  # back at EP 2 the run is the uninterrupted one
    for ep1, ep2 in zip(losses["B"], losses["A"][2:]):
        assert abs(ep1 - ep2) <= EP_CHANGE_REL_TOL * abs(ep2), (losses["B"], losses["A"])


@pytest.mark.slow
def test_resume_at_another_data_parallel_size_continues(layouts, tmp_path, one_thread):
    out, losses = layouts
    argv = FLAGS + ["--save", str(tmp_path)]
    resumed = run(single_rank_groups(), argv, out / "A" / iter_name(2), save_at_start=True)
    assert _same_tensors(checkpoint_tensors(tmp_path / iter_name(2)),
                         checkpoint_tensors(out / "A" / iter_name(2)))
    assert len(resumed) == 2 and all(math.isfinite(x) for x in resumed)
    # one rank sees half the data of two: same model, other batches, so only roughly equal
    assert abs(resumed[0] - losses["A"][2]) < 0.1 * losses["A"][2]


def _train(argv, resume=None):
    trainer = Trainer(parse_config(argv), single_rank_groups(), log=lambda msg: None,
                      resume=resume)
    try:
        return [r.loss for r in trainer.train()]
    finally:
        trainer.close()


def test_a_save_cut_off_is_never_loaded(tmp_path, monkeypatch, one_thread):
    argv = FLAGS + ["--train-iters", "4", "--save", str(tmp_path), "--save-interval", "2"]
    full = _train(FLAGS + ["--train-iters", "4"])
    publish = files.publish

    def cut_off_at_4(temp, save_dir, step, meta):  # every rank's data is written by then
        if step == 4:
            raise KeyboardInterrupt("killed while publishing")
        return publish(temp, save_dir, step, meta)
    monkeypatch.setattr(files, "publish", cut_off_at_4)
    with pytest.raises(KeyboardInterrupt):
        _train(argv)
    monkeypatch.undo()
    temp = tmp_path / f".tmp-{iter_name(4)}"
    assert (temp / ".metadata").is_file() and not (tmp_path / iter_name(4)).exists()
    (tmp_path / iter_name(6)).mkdir()  # e.g. copied in part: no meta.json
    shutil.copy(temp / ".metadata", tmp_path / iter_name(6))
    ref = find_resume_checkpoint(str(tmp_path), str(tmp_path))
    assert ref.step == 2 and (tmp_path / files.TRACKER).read_text() == "2\n"
    assert _train(argv, ref) == full[2:]  # the previous complete one, bitwise


@pytest.mark.parametrize("saved_with, resumed_with",
                         [("flat", "single"), ("single", "flat"), ("flat", "flat")])
def test_a_checkpoint_of_one_adamw_form_resumes_with_another(tmp_path, monkeypatch, one_thread,
                                                             saved_with, resumed_with):
    """Saved at step 2 by one form (`optim.ADAM_IMPLS`), loaded by another and saved back at
    once: every key the same bits (masters, moments, step counts). The forms differ in the last
    bits of an update (`kernels.adamw`), so the steps after differ by rounding only; the same
    form resumes bitwise."""
    from epoverlap.training.optimizer import optim

    argv = FLAGS + ["--train-iters", "4"]
    monkeypatch.setattr(optim, "default_adam_impl", lambda device: saved_with)
    full = _train(argv + ["--save", str(tmp_path / "A"), "--save-interval", "2"])
    monkeypatch.setattr(optim, "default_adam_impl", lambda device: resumed_with)
    resumed = run(single_rank_groups(), argv + ["--save", str(tmp_path / "B")],
                  tmp_path / "A" / iter_name(2), save_at_start=True)
    saved = checkpoint_tensors(tmp_path / "A" / iter_name(2))
    assert any(key.endswith("/exp_avg_sq") for key in saved)
    assert _same_tensors(checkpoint_tensors(tmp_path / "B" / iter_name(2)), saved)
    if saved_with == resumed_with:
        assert resumed == full[2:]
    for other, uninterrupted in zip(resumed, full[2:]):
        assert abs(other - uninterrupted) <= 1e-5 * abs(uninterrupted), (resumed, full)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _train(FLAGS + ["--train-iters", "1", "--save", str(folder)])
    torch.set_num_threads(threads)
    return folder


def _error(load: Path, argv=(), save=None) -> str:
    with pytest.raises(CheckpointError) as info:
        _train(FLAGS + list(argv) + ["--load", str(load)],
               find_resume_checkpoint(str(load), save))
    message = str(info.value)
    assert message.startswith(f"--load={load}: ") and "\n" not in message
    return message


def test_nothing_to_resume_starts_fresh_only_where_save_writes(tmp_path):
    assert find_resume_checkpoint(str(tmp_path / "new"), str(tmp_path / "new")) is None
    message = _error(tmp_path / "new")
    assert "no complete checkpoint" in message and "--save" in message


def test_a_checkpoint_of_another_model_is_refused_naming_key_and_flag(saved):
    message = _error(saved, ["--hidden-size", "64"])
    assert "written for another model: model/embedding is [256, 32] there, [256, 64] here " \
           "(flags that differ: --hidden-size 32 -> 64)" in message, message
    message = _error(saved, ["--num-experts", "8"])
    assert "buffer/layers.0.router.expert_bias is [4] there, [8] here" in message, message
    assert "--num-experts 4 -> 8" in message


@pytest.mark.parametrize("damage, fragment", [
    ("truncate", "truncated"), ("delete", "missing"), ("meta", "meta.json: unreadable"),
    ("index", ".metadata: unreadable"), ("scramble", "__0_0.distcp: unreadable on rank 0"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file(saved, tmp_path, damage, fragment):
    copy = tmp_path / "copy"
    shutil.copytree(saved / iter_name(1), copy)
    data = copy / "__0_0.distcp"
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "delete":
        data.unlink()
    elif damage == "meta":
        (copy / "meta.json").write_text("{not json")
    elif damage == "index":
        (copy / ".metadata").write_bytes(b"garbage")
    else:  # same size, every record's header overwritten
        raw = bytearray(data.read_bytes())
        raw[:] = bytes(len(raw))
        data.write_bytes(bytes(raw))
    message = _error(copy)
    assert fragment in message, message
    named = "meta.json" if damage == "meta" else ".metadata" if damage == "index" \
        else "__0_0.distcp"
    assert named in message, message


def test_meta_json_records_step_layout_and_config(saved):
    meta = json.loads((saved / iter_name(1) / "meta.json").read_text())
    assert meta["step"] == 1 and meta["world_size"] == 1 and meta["ep_size"] == 1
    assert meta["config"]["model"]["hidden_size"] == 32 and meta["loss_scale"] is None
    assert meta["optimizer_state"] is True


@pytest.mark.slow
def test_nan_stops_the_step_naming_rank_and_parameter_before_the_optimizer(two_ranks):
    results = [per_rank["nan"] for per_rank in two_ranks[1]]
    for per_fault in results:  # every rank raised, with the same message
        for (message, unchanged), where in zip(per_fault, FAULTS.values()):
            assert message is not None and message.startswith("step 3: "), message
            assert where in message, message
            assert message.endswith("stopped before the optimizer step (optimizer state "
                                    "unchanged)")
            assert unchanged
    grad_message = results[0][0][0]
    assert "rank 0:" not in grad_message  # injected after the backward: rank 0 stays clean
    assert results[0] == results[1]


def test_nan_stops_the_step_before_the_optimizer_on_one_rank(one_thread):
    """Default tier: the NaN check of one in-process rank (the 2-rank test above is the slow
    tier's), a NaN gradient and a NaN loss each at step 3."""
    from checkpoint_workers import nan_is_caught_before_the_optimizer
    faults = {"nan-grad@3:0:layers.1.experts.fc2": "rank 0: NaN/Inf in the gradient of "
                                                  "layers.1.experts.fc2 (first of 1 "
                                                  "parameter(s))",
              "nan-loss@3:0": FAULTS["nan-loss@3:0"]}
    results = nan_is_caught_before_the_optimizer(single_rank_groups(), list(faults))
    for (message, unchanged), where in zip(results, faults.values()):
        assert message is not None and message.startswith("step 3: ") and where in message, \
            message
        assert message.endswith("stopped before the optimizer step (optimizer state "
                                "unchanged)")
        assert unchanged


def _train_results(argv, resume=None):
    trainer = Trainer(parse_config(argv), single_rank_groups(), log=lambda msg: None,
                      resume=resume)
    try:
        return [(float.hex(r.loss), r.dispatch_reruns, r.dispatch_budget)
                for r in trainer.train()]
    finally:
        trainer.close()


def test_a_resumed_run_remembers_the_budget_levels_of_the_saved_one(tmp_path, one_thread):
    """--moe-dispatch-budget-memory: the levels are saved with the checkpoint, so the resumed
    steps start where the uninterrupted run's did (same reruns, budgets and losses)."""
    argv = FLAGS + ["--moe-dispatch-budget", "0.25", "--moe-dispatch-budget-memory", "4"]
    whole = _train_results(argv + ["--save", str(tmp_path), "--save-interval", "2"])
    assert whole[0][1] >= 1 and whole[2][1] == 0  # step 1 overflowed; step 3 started above
    resumed = _train_results(argv, files.read_checkpoint(tmp_path / iter_name(2), str(tmp_path)))
    assert resumed == whole[2:]


def test_a_resumed_run_keeps_the_fitted_budget_of_the_saved_one(tmp_path, one_thread):
    """--moe-dispatch-budget-fit: the fitted base and the demand it came from are saved with
    the checkpoint, so the resumed steps run at the uninterrupted run's budgets (a fresh fit
    would start again at the flag's 0.25 and rerun step 3)."""
    argv = FLAGS + ["--moe-dispatch-budget", "0.25", "--moe-dispatch-budget-memory", "4",
                    "--moe-dispatch-budget-fit"]
    whole = _train_results(argv + ["--save", str(tmp_path), "--save-interval", "2"])
    assert whole[0][1] >= 1 and all(reruns == 0 and budget > 0.25
                                    for _, reruns, budget in whole[1:])
    resumed = _train_results(argv, files.read_checkpoint(tmp_path / iter_name(2), str(tmp_path)))
    assert resumed == whole[2:]
