"""Data: Megatron-core's indexed token format (`indexed`), tokenizers (`tokenizers`), and how
indexed datasets become training samples: split, epochs, shuffling, blend (`samples`).

The lowest layer: imports nothing from epoverlap but itself (numpy only; `tokenizers` lazily).
"""
