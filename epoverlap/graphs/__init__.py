"""CUDA graphs: the configuration surface users of the reference framework know, with its
deprecated forms (`config`).

May import: errors. The schedule runs nodes through this package; the model never sees it.
"""
