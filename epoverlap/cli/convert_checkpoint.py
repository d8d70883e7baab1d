"""Megatron-core checkpoints to epoverlap checkpoints and back: `epoverlap-convert-checkpoint`.

  epoverlap-convert-checkpoint --from-megatron DIR --out DIR2 [--step N] [TRAINING FLAGS ...]
      DIR: a Megatron-core torch_dist checkpoint folder (what dist_checkpointing.save writes),
      or a Megatron-LM save folder (--step N's iter_000000N, else the one its
      latest_checkpointed_iteration.txt names). Writes DIR2/iter_000000N, an epoverlap
      checkpoint of the same step for the model the training flags describe (the same flags as
      epoverlap-train: --preset, --num-layers, --num-experts, ..., and the data flags, which
      set the vocabulary); `epoverlap-train --load DIR2 ...` resumes from it (weights only: a
      fresh optimizer; --finetune starts at step 0 instead).
  epoverlap-convert-checkpoint --to-megatron DIR --out DIR2 [--step N] [TRAINING FLAGS ...]
      DIR: an epoverlap checkpoint folder or --save folder (--step N's, else the newest).
      Writes DIR2/iter_000000N, a Megatron-core torch_dist checkpoint that
      dist_checkpointing.load reads into a GPTModel of the same config (untied output layer),
      and DIR2/latest_checkpointed_iteration.txt. The model is the checkpoint's own (its
      meta.json), or the training flags' when given.

Every tensor's name and shape is checked against the epoverlap model before any data is read;
the first that differs, or a Megatron-core tensor epoverlap's model has no place for, is one
line naming it. Which tensor is which: `epoverlap.training.checkpoints.megatron_mapping`, and
docs/megatron.md ("Bringing a Megatron-core checkpoint").

Exit status 0 written (one line: what, where, the step; then notes), 2 bad input (one line
naming the file, tensor or flag).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from epoverlap.errors import ConfigError
from epoverlap.training.checkpoints.megatron_checkpoint import LAYOUTS
from epoverlap.training.checkpoints.megatron_convert import from_megatron, to_megatron
from epoverlap.training.checkpoints.megatron_mapping import ConversionError, model_config_of

PROG = "epoverlap-convert-checkpoint"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        usage=f"{PROG} (--from-megatron DIR | --to-megatron DIR) --out DIR2 [--step N] "
              "[TRAINING FLAGS ...]",
        description="Convert a Megatron-core torch_dist checkpoint (GPTModel with MoE layers) "
                    "to an epoverlap checkpoint, or back. Any other flag is a training flag "
                    "(epoverlap-train --help): they describe the model, and every tensor is "
                    "checked against it.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-megatron", metavar="DIR",
                        help="a Megatron-core torch_dist checkpoint (or Megatron-LM save "
                             "folder) to read")
    source.add_argument("--to-megatron", metavar="DIR",
                        help="an epoverlap checkpoint (or --save folder) to read")
    parser.add_argument("--out", required=True, metavar="DIR2",
                        help="where the converted checkpoint's iter_NNNNNNN folder is written")
    parser.add_argument("--step", type=int, default=None, metavar="N",
                        help="the iteration to read from a save folder (default: the newest); "
                             "a checkpoint folder not named iter_NNNNNNN gets this step "
                             "(default: its common.pt's iteration, else 0)")
    parser.add_argument("--untie-embeddings", action="store_true",
                        help="--from-megatron, a checkpoint whose output layer is tied to the "
                             "embedding: copy the embedding into epoverlap's output head")
    parser.add_argument("--trim-vocab", action="store_true",
                        help="--from-megatron: keep the first rows of an embedding and output "
                             "layer padded to more rows than these flags pad the vocabulary to "
                             "(the same --make-vocab-size-divisible-by as the Megatron-LM run, "
                             "times its tensor-parallel size, needs no trim)")
    parser.add_argument("--megatron-layout", choices=LAYOUTS, default="auto",
                        help="--to-megatron: the decoder layers' keys: stacked ([layers, ...] "
                             "tensors, Megatron-core's default for alike layers with "
                             "--moe-layer-freq 1) or per-layer (its layout otherwise); "
                             "default auto: the one Megatron-core asks for")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, training_flags = build_parser().parse_known_args(argv)
    try:
        if args.from_megatron is not None:
            cfg = model_config_of(training_flags, PROG)
            done = from_megatron(args.from_megatron, args.out, cfg, args.step,
                                 untie=args.untie_embeddings, trim_vocab=args.trim_vocab)
            what = "epoverlap checkpoint"
            then = f"train with: epoverlap-train --load {args.out} (and the same flags)"
        else:
            cfg = model_config_of(training_flags, PROG) if training_flags else None
            done = to_megatron(args.to_megatron, args.out, cfg, args.step,
                               args.megatron_layout)
            what, then = "Megatron-core torch_dist checkpoint", None
    except (ConversionError, ConfigError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {what} {done.path} (step {done.step}, {done.tensors} tensors)")
    for note in done.notes + ([then] if then else []):
        print(f"  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
