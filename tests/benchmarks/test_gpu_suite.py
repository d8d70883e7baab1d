"""benchmarks/harness/gpu_suite.sh, the one script every device call runs, checked on CPU: it parses, every
part it implements is listed in its header (and nothing else is), and its NCCL setting entries
(`tag` or `tag:VAR=val,VAR=val`, x2nccl's NCCL_SETS and x2once's ONCE_ENV_SETS) split into the
tag and the environment assignments a step runs under; a 2-GPU part's TESTS run first, on
its GPUs, with its time limit unless TEST_TIMEOUT says otherwise."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[2] / "benchmarks" / "harness" / "gpu_suite.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_the_suite_parses():
    subprocess.run(["bash", "-n", str(SUITE)], check=True)


def test_every_part_is_listed_in_the_header_and_every_listed_part_exists():
    text = SUITE.read_text()
    listed = set(re.findall(r"^#   tools/gpu_suite\.sh ([a-z0-9]+)", text, re.M))
    implemented = set(re.findall(r"^  ([a-z0-9]+)\)", text, re.M))
    assert {"x2nccl", "x2once", "x2green"} <= implemented
    assert listed == implemented, (f"in the header only: {sorted(listed - implemented)}; "
                                   f"implemented only: {sorted(implemented - listed)}")


def _function(name: str) -> str:
    match = re.search(rf"^{name}\(\) \{{.*?^\}}$", SUITE.read_text(), re.M | re.S)
    assert match, f"{name}() not found in benchmarks/harness/gpu_suite.sh"
    return match.group(0)


def _parse(entry: str) -> list[str]:
    """What env_set makes of one entry: the tag, then each assignment, one per line."""
    script = (_function("env_set") + "\nset -u\n"
              + f'env_set "{entry}"\nprintf "%s\\n" "$SET_TAG" "${{SET_ENVS[@]}}"\n')
    out = subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True)
    return out.stdout.splitlines()


def test_a_bare_tag_sets_nothing():
    assert _parse("base") == ["base"]


def test_a_tag_with_assignments_splits_on_commas():
    entry = "c2m:NCCL_P2P_PCI_CHUNKSIZE=2097152,NCCL_BUFFSIZE=33554432,NCCL_DEBUG=INFO"
    assert _parse(entry) == ["c2m", "NCCL_P2P_PCI_CHUNKSIZE=2097152", "NCCL_BUFFSIZE=33554432",
                             "NCCL_DEBUG=INFO"]


def test_an_entry_does_not_leak_into_the_next():
    script = (_function("env_set") + "\nset -u\n"
              + 'env_set "a:X=1,Y=2"; env_set "b"; echo "$SET_TAG ${#SET_ENVS[@]}"\n')
    out = subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "b 0"


def _tests_first(environ: dict) -> str:
    """What tests_first hands to `step` (stubbed: its name, limit, GPUs and command)."""
    script = ('step() { echo "$1 $STEP_TIMEOUT $CUDA_VISIBLE_DEVICES ${*:2}"; }\n'
              + _function("tests_first") + "\nTWO_GPUS=0,1\ntests_first probe_tests 300\n")
    out = subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", **environ})
    return out.stdout.strip()


def test_a_part_runs_its_tests_first_only_when_given():
    assert _tests_first({}) == ""
    assert _tests_first({"TESTS": "tests/test_gpu.py -k probe"}) == (
        "probe_tests 300 0,1 python3 -m pytest tests/test_gpu.py -k probe -q "
        "-p no:cacheprovider --durations=8")
    assert _tests_first({"TESTS": "tests/test_gpu.py", "TEST_TIMEOUT": "90"}).startswith(
        "probe_tests 90 0,1 ")
