"""The configuration: every flag, default, preset and cross-field rule, in one layer that the
model and the runtime import and that imports neither.

  sections.py          the config dataclasses; each flag is declared beside its field
  run.py               RunConfig: the sections together and what is derived from several
  cuda_graphs.py       the CUDA-graph section and the migration of its deprecated spellings
  data_text.py         the data flags' text read: --split proportions, --data-path blends
  flags.py             how a field becomes a flag (`flag`, the generated argparse surface)
  parse.py             the training command's parser and `parse_config`
  presets.py           --preset NAME
  resolve.py           the `auto` defaults, resolved from the world and device; `validate_config`
  validate.py          every rule (`check_config`), one ConfigError line naming the flag
  cuda_graph_rules.py  the CUDA-graph rules validate_config runs
  layer_freq.py        --moe-layer-freq's list forms (Megatron-LM's list expressions)
  dispatch.py          what a dispatch mode is: its sizing and routing, host reads, row counts
  dispatch_rules.py    the one table of what the dispatch does not run with (graphs, chunks...)
  tuning.py            the paths --tune chooses between, its pinned axes and window
  aliases.py           the one way an old flag spelling is migrated
"""

from epoverlap.config.cuda_graphs import CudaGraphConfig
from epoverlap.config.data_text import parse_blend, parse_split
from epoverlap.config.dispatch import DispatchMode
from epoverlap.config.parse import CHOICES, FLAGS, build_parser, config_from_args, flag_of, \
    parse_config
from epoverlap.config.presets import PRESETS
from epoverlap.config.run import SECTIONS, ModelOptions, RunConfig, moe_layer_pattern
from epoverlap.config.sections import (DEFAULT_SPLIT, CheckpointConfig, DataConfig, KernelConfig,
                                       LogConfig, ModelConfig, MoEConfig, OverlapConfig,
                                       ParallelConfig, TrainConfig)
from epoverlap.config.resolve import resolve_config, validate_config
from epoverlap.config.validate import nccl_config_unavailable, world_size_from_env

__all__ = [
    "CHOICES", "DEFAULT_SPLIT", "FLAGS", "PRESETS", "SECTIONS", "CheckpointConfig",
    "CudaGraphConfig", "DataConfig", "DispatchMode", "KernelConfig", "LogConfig", "ModelConfig",
    "ModelOptions", "MoEConfig", "OverlapConfig", "ParallelConfig", "RunConfig", "TrainConfig",
    "build_parser", "config_from_args", "flag_of", "moe_layer_pattern", "nccl_config_unavailable",
    "parse_blend", "parse_config", "parse_split", "resolve_config", "validate_config",
    "world_size_from_env",
]
