"""Which compiled variants the Triton kernels would need as row counts change (no GPU needed).

Run as a script (TRITON_INTERPRET unset): the sm_90 stand-in driver of `sm90_compile` records
the specialization key of every launch instead of running it; the ops of one MoE layer (router,
row-id map, permute, chunk sort, SwiGLU, unpermute, RMSNorm, row gather, padding-row
zeroing), forward and backward, run on CPU
tensors: TOKENS local tokens, then each RECEIVED row count in turn (what the expert side of
dropless routing sees change from step to step). Usage: specialization_keys.py TOKENS RECEIVED... Prints JSON: kernel name -> number of distinct keys.
"""

from __future__ import annotations

import json
import sys


def _layer_ops(tokens: int, received: int) -> None:
    import torch
    from epoverlap.kernels import triton_ops as ops

    hidden, experts, topk, ffn = 256, 8, 2, 128
    logits_TE = torch.randn(tokens, experts, requires_grad=True)
    probs_TE, routing_map_TE, _ = ops.router_topk_with_counts(logits_TE, topk)
    probs_TE.sum().backward()
    x_TH = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    normed_TH = ops.rms_norm(x_TH, torch.ones(hidden, dtype=torch.bfloat16), 1e-5)
    routing_map_TE = torch.zeros(tokens, experts, dtype=torch.bool)
    routing_map_TE[:, :topk] = True
    merge_TE = torch.rand(tokens, experts, requires_grad=True)
    permuted_NH, permuted_probs_N, row_id_map_TE = ops.permute(
        normed_TH, routing_map_TE, merge_TE, num_out_tokens=tokens * topk)
    recv_MH = torch.randn(received, hidden, dtype=torch.bfloat16, requires_grad=True)
    recv_probs_M = torch.rand(received, requires_grad=True)
    splits = torch.tensor([received // 2, received - received // 2, 0, 0])
    rows_MH, rows_probs_M = ops.sort_chunks_by_idxs(recv_MH, splits, torch.tensor([1, 0, 3, 2]),
                                                    recv_probs_M)
    h_M2F = torch.randn(received, 2 * ffn, dtype=torch.bfloat16, requires_grad=True)
    act_MF = ops.swiglu(h_M2F, rows_probs_M)
    (act_MF.float().sum() + rows_MH.float().sum()).backward()
    out_TH = ops.unpermute(permuted_NH, row_id_map_TE)
    out_TH.float().sum().backward()
    index_M = torch.arange(received) - 1  # the budget dispatch's row moves, then its padding
    ops.gather_rows(recv_MH.detach(), index_M)
    ops.gather_rows(recv_probs_M.detach(), index_M)
    ops.zero_rows_from(h_M2F * 1, torch.tensor([received // 2], dtype=torch.int32))


def main(argv: list[str]) -> int:
    from epoverlap.kernels import triton_utils
    from sm90_compile import install_fake_sm90_driver

    keys: dict = {}

    def record(jit_function, key, compile):
        keys.setdefault(jit_function.fn.__name__, set()).add(str(key))

    install_fake_sm90_driver(record)
    triton_utils.check_count_fits = lambda *args: None  # nothing runs: the counts are garbage
    triton_utils.device_asserts = lambda tensor: True  # the CUDA launch configs
    tokens = int(argv[0])
    for received in (int(a) for a in argv[1:]):
        _layer_ops(tokens, received)
    print(json.dumps({name: len(found) for name, found in sorted(keys.items())}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
