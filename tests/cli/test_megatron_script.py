"""A Megatron-LM user's command line through the real commands (CPU): the launcher refuses
each flag epoverlap does not build in a line of its own, before torchrun starts."""

from __future__ import annotations

import subprocess
import sys

from job_control import REPO, job_env


def test_the_launcher_refuses_each_unbuilt_flag_in_a_line_of_its_own():
    result = subprocess.run([sys.executable, "-m", "epoverlap.cli.launch", "--fp16",
                             "--eod-mask-loss"], capture_output=True, text=True, env=job_env(),
                            cwd=REPO, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "epoverlap-launch: error: --fp16=True: fp16 training is not implemented; use --bf16",
        "epoverlap-launch: error: --eod-mask-loss=True: masking the loss at end-of-document "
        "tokens is not implemented"]
