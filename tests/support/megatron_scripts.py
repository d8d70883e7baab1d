"""The Megatron-LM pretrain scripts' arguments kept in tests/fixtures/megatron_scripts, read as
argument lists and grouped per flag."""

from __future__ import annotations

from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_scripts"
NAMES = ("mixtral_8x7b_distributed.args", "deepseek_v3_moe.args",
         "deepseek_proxy_ep_overlap.args")
EP_OVERLAP = "deepseek_proxy_ep_overlap.args"  # Megatron-LM's EP-overlap functional test


def script_args(name: str) -> list[str]:
    return [token for line in (SCRIPTS / name).read_text().splitlines()
            if line.strip() and not line.startswith("#") for token in line.split()]


def flag_values(args: list[str]) -> list[list[str]]:
    """The arguments grouped as [flag, value, ...] per flag."""
    groups: list[list[str]] = []
    for token in args:
        if token.startswith("--"):
            groups.append([token])
        else:
            groups[-1].append(token)
    return groups
