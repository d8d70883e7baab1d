"""epoverlap: an expert-parallel MoE training runtime that hides the all-to-all behind compute.

One subpackage per layer; each may import only the layers listed before it:

  errors, flag_aliases, config
                    every flag, default, preset and cross-field rule, the migration of old
                    flag spellings (config imports only data/'s tokenizer names and graphs/)
  data/             Megatron-core's .bin/.idx format, tokenizers, split/epochs/shuffle/blend
                    (imports nothing else of epoverlap)
  model/            the transformer and MoE layers as node callables (knows no schedule)
  parallel/         process groups and the expert-parallel all-to-all
  schedule/         plans as data, the executor (the only owner of streams and events),
                    cutting nodes out of autograd, the weight-grad queue
  graphs/           CUDA-graph configuration surface and capture
  profiling/        span recording and the span file format
  training/         the trainer, data, optimizer, grad buffers, the command and the launcher

`python -m epoverlap.train` is the training command (what torchrun runs).
"""
