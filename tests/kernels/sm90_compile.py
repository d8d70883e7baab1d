"""Compile every Triton kernel for sm_90 (H100/H200) on a machine without a GPU.

Run as a script (`python tests/kernels/sm90_compile.py [--json]`, TRITON_INTERPRET unset): a
stand-in Triton driver reports an sm_90 target, a JIT cache hook compiles each launch the public
ops make (PTX + cubin with the bundled ptxas) and stops it from running, and the ops run on small
CPU tensors with the benchmark shapes' hidden sizes, expert counts and dtypes, so the launch
configs (tiles, warps, constexprs, divisibility specializations) are the GPU's. Prints one line
per compiled kernel: registers, local memory (spills), and the count of 16-byte global loads and
stores in the PTX ("debug" marks a kernel compiled with its device asserts, as CUDA launches the
bound checks). Outputs of the ops are garbage (nothing runs); only compilation is checked.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

TARGET_ARCH = 90


def install_fake_sm90_driver(on_launch) -> None:
    """A stand-in driver reporting sm_90, and a JIT cache hook that calls
    `on_launch(jit_function, key, compile_info)` for each launch that misses the in-memory cache
    and stops it from running (nothing ever launches)."""
    import torch
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Sm90Driver:
        def get_current_target(self):
            return GPUTarget("cuda", TARGET_ARCH, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    def hook(*, key, fn, compile, **_):
        on_launch(fn.jit_function, key, compile)
        return True  # never launch

    driver.set_active(_Sm90Driver())
    knobs.runtime.jit_cache_hook = hook


def _install_fake_driver(records: list[dict], context: dict) -> None:
    """Compile (PTX + cubin) each distinct launch for sm_90 and record its resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget

    seen: set = set()

    def compile_launch(jit_function, key, compile):
        name = jit_function.fn.__name__
        if (name, str(key)) in seen:
            return
        seen.add((name, str(key)))
        src = triton.compiler.ASTSource(jit_function, compile["signature"], compile["constants"],
                                        compile["configs"][0])
        launch_options = json.loads(compile["specialization_data"])["options"]
        options = {k: compile[k] for k in ("num_warps", "num_stages", "num_ctas")}
        options.update({k: launch_options[k] for k in ("debug", "sanitize_overflow",
                                                        "enable_fp_fusion")})
        kernel = triton.compile(src, target=GPUTarget("cuda", TARGET_ARCH, 32), options=options)
        records.append(dict(_describe(name, compile, kernel), shape=context.get("shape"),
                            debug=options["debug"]))

    install_fake_sm90_driver(compile_launch)


def _describe(name: str, compile: dict, kernel) -> dict:
    import triton
    ptx = kernel.asm["ptx"]
    usage = _resource_usage(kernel.asm["cubin"], Path(triton.__file__).parent)
    consts = {str(k): v for k, v in compile["constants"].items()}
    return {"kernel": name, "num_warps": compile["num_warps"], "constants": consts,
            "signature": {k: v for k, v in compile["signature"].items() if v != "constexpr"},
            "regs": usage.get("REG"), "local_bytes": usage.get("LOCAL"),
            "stack_bytes": usage.get("STACK"),
            "v4_loads": len(re.findall(r"ld\.global(\.\w+)*\.v4", ptx)),
            "v4_stores": len(re.findall(r"st\.global(\.\w+)*\.v4", ptx)),
            "fp32_fmas": len(re.findall(r"fma\.\w+\.f32", ptx)),
            "approx_ops": len(re.findall(r"\.approx\.", ptx))}


def _resource_usage(cubin: bytes, triton_dir: Path) -> dict:
    tool = triton_dir / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"sm90_check_{os.getpid()}.cubin"
    path.write_bytes(cubin)
    try:
        out = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True,
                             text=True, check=True).stdout
    finally:
        path.unlink(missing_ok=True)
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", out)}


def _exercise_ops(context: dict) -> None:
    """Every op, forward and backward, at the benchmark shapes' H / E / k, with few tokens."""
    import torch
    from epoverlap.kernels import triton_ops as ops
    from epoverlap.kernels import triton_utils

    triton_utils.check_count_fits = lambda *args: None  # nothing runs: the counts are garbage
    triton_utils.device_asserts = lambda tensor: True  # compile the CUDA launch configs

    shapes = [(7168, 256, 8, dict(score_function="sigmoid", num_groups=8, group_topk=4,
                                  scaling_factor=2.5, expert_bias=torch.zeros(256))),
              (4096, 8, 2, dict(score_function="softmax"))]
    for hidden, experts, topk, router_kwargs in shapes:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            _exercise_shape(ops, context, 16, hidden, experts, topk, dtype, router_kwargs)
    _exercise_shape(ops, context, 16, 1000, 12, 3, torch.bfloat16,
                    dict(score_function="softmax", use_pre_softmax=True))


def _exercise_shape(ops, context, tokens, hidden, experts, topk, dtype, router_kwargs) -> None:
    import torch
    from epoverlap.kernels.permutation_triton import build_row_id_map_triton
    context["shape"] = f"H{hidden}-E{experts}-k{topk}-{str(dtype).split('.')[-1]}"
    # the map kernels' tiles depend on T: build the benchmark's 8192-token map too
    build_row_id_map_triton(torch.zeros(8192, experts, dtype=torch.bool),
                            num_out_tokens=8192 * topk)
    logits = torch.randn(tokens, experts, dtype=dtype, requires_grad=True)
    probs, routing_map, _ = ops.router_topk_with_counts(logits, topk, **router_kwargs)
    probs.sum().backward()
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool)
    routing_map[:, :topk] = True
    merge = torch.rand(tokens, experts, dtype=dtype, requires_grad=True)
    permuted, permuted_probs, row_id_map = ops.permute(x, routing_map, merge,
                                                       num_out_tokens=tokens * topk)
    splits = torch.full((4,), tokens * topk // 4)
    rows, rows_probs = ops.sort_chunks_by_idxs(permuted, splits, torch.tensor([2, 0, 3, 1]),
                                               permuted_probs)
    out = ops.unpermute(rows * rows_probs[:, None], row_id_map, probs=merge)
    out.float().sum().backward()
    ops.unpermute(permuted.detach().requires_grad_(), row_id_map).float().sum().backward()
    index = torch.arange(tokens * topk) - 1  # the budget dispatch's moves: [N, H], [N] probs
    ops.gather_rows(permuted.detach(), index)
    ops.gather_rows(permuted_probs.detach(), index)
    padded = ops.zero_rows_from(x * 1, torch.tensor([tokens // 2], dtype=torch.int32))
    padded.float().sum().backward()


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET to compile for sm_90", file=sys.stderr)
        return 2
    records: list[dict] = []
    context: dict = {}
    _install_fake_driver(records, context)
    _exercise_ops(context)
    if "--json" in argv:
        print(json.dumps(records))
        return 0
    for r in records:
        consts = ", ".join(f"{k}={v}" for k, v in r["constants"].items())
        debug = " debug" if r["debug"] else ""
        print(f"{r['shape']:<22} {r['kernel']:<24} warps={r['num_warps']}{debug} regs={r['regs']} "
              f"local={r['local_bytes']} v4ld={r['v4_loads']} v4st={r['v4_stores']} "
              f"[{consts}] {r['signature']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
