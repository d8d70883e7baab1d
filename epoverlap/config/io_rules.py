"""The rules for what a run reads and writes: its data source, every output path (checked
writable before training, so a bad path costs no step), profiling, TensorBoard, W&B, per-rank
logs, checkpoints and their load options, evaluation and the exit options.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from epoverlap.config.parse import flag_of, require
from epoverlap.config.run import RunConfig
from epoverlap.config.sections import DEFAULT_SPLIT, DataConfig, LogConfig
from epoverlap.errors import ConfigError


def validate_io(cfg: RunConfig, device: str) -> None:
    """Every rule of this module (device: the one the run resolves to)."""
    _validate_data(cfg.data)
    log = cfg.log
    require(log.log_interval >= 1, "log_interval", log.log_interval, "must be >= 1")
    _validate_profile(log, device)
    if log.log_json is not None:
        require_writable("log_json", log.log_json, directory=False)
    if log.log_dir is not None:
        require_writable("log_dir", log.log_dir, directory=True)
    _validate_tensorboard(log)
    _validate_wandb(log)
    _validate_checkpoint(cfg)
    _validate_eval(cfg)


def _validate_data(d: DataConfig) -> None:
    """Flag-level rules; the files themselves are checked by
    `training.setup.data.open_data_source`."""
    given = [flag for flag, on in (("--data", d.data is not None),
                                   ("--data-path", bool(d.data_path)),
                                   ("--mock-data", d.mock_data)) if on]
    if len(given) > 1:
        raise ConfigError(given[1], True, f"give one data source; {given[0]} is given too")
    if d.data not in (None, "stdlib"):
        require(Path(d.data).exists(), "data", d.data,
                 "no such file or folder (or use 'stdlib', --data-path or --mock-data)")
    if d.data_path:
        try:
            d.blend
        except ValueError as error:
            raise ConfigError("--data-path", d.data_path, str(error)) from None
        require(d.tokenizer is not None, "data_path", d.data_path,
                 "needs --tokenizer-type (NullTokenizer with --vocab-size, HuggingFaceTokenizer "
                 "or Llama2Tokenizer with --tokenizer-model, GPT2BPETokenizer with --vocab-file "
                 "and --merge-file)")
    for name in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask"):
        require(not getattr(d, name) or bool(d.data_path), name, True,
                "needs --data-path: the other sources have no end-of-document tokens")
    if d.split is not None:
        require(bool(d.data_path) or d.mock_data, "split", d.split,
                "applies to --data-path datasets and --mock-data")
        try:
            d.split_fractions
        except ValueError as error:
            raise ConfigError("--split", d.split, str(error)) from None
    _validate_tokenizer(d)


MODEL_FILE = {"HuggingFaceTokenizer": "a tokenizer.json or a folder holding one",
              "Llama2Tokenizer": "a SentencePiece tokenizer.model"}


def _validate_tokenizer(d: DataConfig) -> None:
    kind = d.tokenizer
    if kind is not None:
        require(d.text_source is None, "tokenizer_type", kind, "--data reads raw bytes "
                 "(vocabulary 256); a tokenizer applies to --data-path and --mock-data")
    require(d.vocab_size is None or kind == "NullTokenizer", "vocab_size", d.vocab_size,
             "only with --tokenizer-type NullTokenizer")
    require(kind != "NullTokenizer" or (d.vocab_size or 0) >= 1, "vocab_size", d.vocab_size,
             "--tokenizer-type NullTokenizer needs --vocab-size >= 1")
    require(d.tokenizer_model is None or kind in MODEL_FILE, "tokenizer_model",
             d.tokenizer_model, f"only with --tokenizer-type {' or '.join(MODEL_FILE)}")
    require(kind not in MODEL_FILE or bool(d.tokenizer_model), "tokenizer_model",
             d.tokenizer_model, f"--tokenizer-type {kind} needs {MODEL_FILE.get(kind)}")
    for name in ("vocab_file", "merge_file"):
        value = getattr(d, name)
        require(value is None or kind == "GPT2BPETokenizer", name, value,
                 "only with --tokenizer-type GPT2BPETokenizer")
        require(kind != "GPT2BPETokenizer" or bool(value), name, value,
                 "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")


def _validate_tensorboard(log: LogConfig) -> None:
    if log.tensorboard_dir is None:
        return
    # the path first: the same answer whether or not the package is installed
    require(_writable_dir(Path(log.tensorboard_dir)), "tensorboard_dir", log.tensorboard_dir,
             "not a writable directory (nor creatable)")
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
    except ImportError:
        raise ConfigError("--tensorboard-dir", log.tensorboard_dir, "needs the tensorboard "
                          "package: pip install 'epoverlap[tensorboard]'") from None


def _writable_dir(path: Path) -> bool:
    """True if `path` is a writable directory or could be created as one."""
    while not path.exists():
        if path.parent == path:
            return False
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _validate_checkpoint(cfg: RunConfig) -> None:
    """Paths and load options; what --load holds is checked by
    training.checkpoints.checkpoint_files, also before training. --save must be writable now, not at
    the first save."""
    c, t = cfg.checkpoint, cfg.train
    for name in ("save", "load"):
        path = getattr(c, name)
        require(path is None or (path.strip() != "" and not Path(path).is_file()), name, path,
                "must name a folder (it is a file, or empty)")
    if c.save is not None:
        require_writable("save", c.save, directory=True)
    if c.load is not None and Path(c.load).exists():
        require(os.access(c.load, os.R_OK | os.X_OK), "load", c.load, "cannot be read")
    if c.save_interval is not None:
        require(c.save_interval >= 1, "save_interval", c.save_interval, "must be >= 1")
    require(not t.exit_signal_handler or c.save is not None, "exit_signal_handler", True,
            "saves a checkpoint on SIGTERM/SIGINT: needs --save DIR")
    if t.exit_duration_in_mins is not None:
        require(t.exit_duration_in_mins > 0, "exit_duration_in_mins", t.exit_duration_in_mins,
                "must be > 0")
    if t.exit_interval is not None:
        require(t.exit_interval >= 1, "exit_interval", t.exit_interval, "must be >= 1")


def _validate_eval(cfg: RunConfig) -> None:
    e = cfg.eval
    if e.eval_interval is None:
        return
    require(e.eval_interval >= 1, "eval_interval", e.eval_interval, "must be >= 1")
    require(e.eval_iters >= 0, "eval_iters", e.eval_iters, "must be >= 0 (0: no evaluation)")
    require(cfg.data.text_source is None, "eval_interval", e.eval_interval,
            "needs validation data: --data-path (its --split valid part) or --mock-data; raw "
            "text (--data) has no valid part")
    if cfg.data.split is not None or cfg.data.data_path:
        require(cfg.data.split_fractions[1] > 0, "eval_interval", e.eval_interval,
                f"--split {cfg.data.split or DEFAULT_SPLIT} leaves no valid part to evaluate")


def _validate_wandb(log: LogConfig) -> None:
    if log.wandb_project is None:
        require(log.wandb_exp_name is None and log.wandb_save_dir is None, "wandb_exp_name",
                log.wandb_exp_name or log.wandb_save_dir, "needs --wandb-project")
        return
    if log.wandb_save_dir is not None:
        require_writable("wandb_save_dir", log.wandb_save_dir, directory=True)
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("--wandb-project", log.wandb_project, "needs the wandb package: "
                          "pip install 'epoverlap[wandb]'") from None


def _validate_profile(log: LogConfig, device: str) -> None:
    if log.profile_steps is None:
        require(log.profile_dir is None, "profile_dir", log.profile_dir,
                 "needs --profile-steps START:END")
        require(not log.use_pytorch_profiler, "use_pytorch_profiler", True,
                 "needs --profile-steps START:END (the steps to trace)")
        return
    require(log.profile_dir is None or not Path(log.profile_dir).is_file(), "profile_dir",
             log.profile_dir, "is a file; give a folder")
    try:
        start, end = log.profile_range
    except ValueError:
        raise ConfigError("--profile-steps", log.profile_steps,
                          "expected START:END step numbers, e.g. 3:5") from None
    require(1 <= start <= end, "profile_steps", log.profile_steps,
             "needs 1 <= START <= END (steps count from 1)")
    require(log.profile_dir is not None, "profile_steps", log.profile_steps,
             "needs --profile-dir DIR")
    require_writable("profile_dir", log.profile_dir, directory=True)
    require(not log.use_pytorch_profiler or device == "cuda", "use_pytorch_profiler", True,
             "needs a CUDA device: its traces are read for GPU kernels (epoverlap-timeline "
             "--torch-trace); on CPU the span files of --profile-steps show both lanes")


def require_writable(field_name: str, path_text: str, directory: bool) -> None:
    """`path_text` is (or can be made) a directory we can write in, or a file we can write.

    Nothing is created: the nearest existing folder must take a new file (tried with a
    temporary file, so root, read-only mounts and /proc are judged as the run would be)."""
    path = Path(path_text)
    if path.exists() and path.is_dir() != directory:
        require(False, field_name, path_text, "is a folder; give a file path" if not directory
                 else "is a file; give a folder (created if missing)")
    folder = path if directory else path.parent
    nearest = folder
    while not nearest.exists():
        nearest = nearest.parent
    require(nearest.is_dir(), field_name, path_text, f"{nearest} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=nearest):
            pass
    except OSError as error:
        raise ConfigError(flag_of(field_name), path_text,
                          f"cannot create a file in {nearest} ({error.strerror})") from None


