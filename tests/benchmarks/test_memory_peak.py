"""benchmarks.harness.memory_peak: the replay of allocator events finds the highest moment and
the blocks alive then, grouped by the innermost epoverlap frame (a hand-written trace)."""

from benchmarks.harness.memory_peak import groups, peak_blocks


def _alloc(addr, size, filename="/x/epoverlap/model/moe.py", line=10):
    return {"action": "alloc", "addr": addr, "size": size,
            "frames": [{"filename": "/torch/nn/functional.py", "line": 1, "name": "linear"},
                       {"filename": filename, "line": line, "name": "forward"}]}


def test_the_peak_is_the_highest_moment_and_its_live_blocks():
    trace = [_alloc(1, 100), _alloc(2, 50, line=20), {"action": "free_requested", "addr": 1},
             {"action": "free_completed", "addr": 1}, _alloc(3, 120),
             {"action": "free_requested", "addr": 9},  # allocated before the history: ignored
             _alloc(4, 10, filename="/torch/optim/adamw.py"),
             {"action": "free_requested", "addr": 3}, _alloc(5, 30)]
    peak, blocks = peak_blocks(trace)
    assert peak == 180 and sorted(blocks) == [2, 3, 4]
    assert groups(blocks) == [
        {"where": "model/moe.py:10 forward", "bytes": 120, "blocks": 1},
        {"where": "model/moe.py:20 forward", "bytes": 50, "blocks": 1},
        {"where": "/torch/nn/functional.py:1 linear", "bytes": 10, "blocks": 1}]
