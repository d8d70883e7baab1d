"""epoverlap: an expert-parallel MoE training runtime that hides the all-to-all behind compute.

One subpackage per layer, listed from the bottom; each imports only the layers above it here:

  errors            the error types every layer raises (ConfigError: one line naming the flag)
  kernels/          Triton kernels, each beside its torch reference, chosen once by config
  data/             Megatron-core's .bin/.idx format, tokenizers, split/epochs/shuffle/blend
  parallel/         process groups, the expert-parallel all-to-all, the liveness watch
  config/           every flag, default, preset and cross-field rule (flags declared beside
                    their dataclass fields), and the dispatch modes' facts
  model/            the transformer and MoE layers as node callables (knows no schedule)
  schedule/         plans as data, the executor (the only owner of streams and events),
                    cutting nodes out of autograd, the weight-grad queue
  graphs/           CUDA-graph capture (per-layer regions, the full iteration)
  profiling/        span recording and the span file format, overlap metrics
  training/         the trainer: building, the step, reporting; checkpoints, optimizer, data
  simulator/        the schedule simulator's engine and cost model
  cli/              the user commands: train, launch, timeline, compare-losses, convert-data,
                    simulate

`python -m epoverlap.train` is the training command (what torchrun runs).
"""
