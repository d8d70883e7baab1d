"""Weights & Biases scalars of a run (`--wandb-project P [--wandb-exp-name N] [--wandb-save-dir
D]`), logged by the first rank.

Owns `WandbLog`, a sink of the same shape as `training.telemetry.tensorboard.TensorBoardLog`:
`write(record)` takes a step's JSON record and logs the scalars TensorBoard gets, under the same
tags (`SCALAR_TAGS`: Megatron-LM's names, the validation loss and perplexity of a step that
evaluated included) at that step; `close()` finishes the W&B run. The run's config is the
resolved `RunConfig`.

Needs the `wandb` package (the optional extra `wandb`; the config refuses the flag without it).
Mode: $WANDB_MODE when set, else online when $WANDB_API_KEY is set, else offline (files only,
`wandb sync` uploads them later). Files go under --wandb-save-dir, else beside --log-json, else
in --save, else in the working folder (W&B adds its `wandb/` folder there).
"""

from __future__ import annotations

import os
from pathlib import Path

from epoverlap.config import RunConfig
from epoverlap.training.telemetry.tensorboard import scalars_of


def wandb_mode() -> str:
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY")
                                            else "offline")


def wandb_dir(cfg: RunConfig) -> str:
    log = cfg.log
    if log.wandb_save_dir is not None:
        return log.wandb_save_dir
    if log.log_json is not None:
        return str(Path(log.log_json).parent)
    return cfg.checkpoint.save or "."


class WandbLog:
    """One W&B run; `write(record)` takes a step's JSON record."""

    def __init__(self, cfg: RunConfig):
        import wandb
        directory = wandb_dir(cfg)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.log.wandb_project, name=cfg.log.wandb_exp_name,
                              dir=directory, config=cfg.to_dict(), mode=wandb_mode())

    def write(self, record: dict) -> None:
        self.run.log(scalars_of(record), step=record["step"])

    def close(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish()
