"""TensorBoard scalars (pure CPU): a step record written by TensorBoardLog (one with a
validation loss too) is read back from the event file with TensorBoard's own reader; the
trainer's ETA formatting."""

from __future__ import annotations

import pytest

from epoverlap.training.telemetry.metrics import EvalResult
from epoverlap.training.telemetry.tensorboard import SCALAR_TAGS, TensorBoardLog
from epoverlap.training.telemetry.metrics import StepResult, format_duration


def test_step_records_round_trip_through_an_event_file(tmp_path):
    pytest.importorskip("tensorboard", reason="the 'tensorboard' extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    log = TensorBoardLog(str(tmp_path))
    for step in (1, 2):
        result = StepResult(step=step, loss=5.0 / step, lr=1e-3 * step, grad_norm=0.5,
                            aux_loss=0.02, load_imbalance=1.5, step_time_s=0.25, tokens=1000,
                            peak_mem_gib=None, tflops_per_gpu=0.01)
        if step == 2:
            result.comm_ms, result.exposed_comm_ms, result.overlap_ratio = 4.0, 1.0, 0.75
            result.dropped_tokens, result.dispatch_reruns = 12, 1
        record = result.to_json()
        if step == 2:  # a step that evaluated
            record.update(EvalResult(step=2, loss=2.25, seconds=0.1, batches=1).record())
        log.write(record)
    log.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    read = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}
    assert read["lm loss"] == [(1, 5.0), (2, 2.5)]
    assert read["tokens-per-sec"] == [(1, 4000.0), (2, 4000.0)]
    assert read["comm/exposed-comm-ms"] == [(2, 1.0)]
    assert read["moe/dropped-tokens"] == [(2, 12.0)]
    assert read["moe/dispatch-reruns"] == [(2, 1.0)]
    assert read["lm loss validation"] == [(2, 2.25)]  # Megatron-LM's validation tags
    assert read["lm loss validation ppl"] == [(2, pytest.approx(9.487735836358526))]
    assert set(read) == set(SCALAR_TAGS.values())


def test_eta_format():
    assert [format_duration(s) for s in (0.04, 7.46, 65, 3725.2)] == ["0.0s", "7.5s", "1m05s",
                                                                      "1h02m05s"]
