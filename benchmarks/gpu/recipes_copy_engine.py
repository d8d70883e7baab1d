"""The copy-engine all-to-all's GPU recipes (--moe-a2a-transport host_memory and peer_memory,
issue 61; benchmarks/copy_engine.md): their GPU tests and contention on one GPU, and for two GPUs
NCCL's own copy-engine knobs and the training step against NCCL."""

from __future__ import annotations

from benchmarks.gpu.recipe_parts import (GRAPHS, SEQUENTIAL, TIER, TRAIN, WGRAD, Recipe, Step,
                                         rounds_step)

# the all-to-all sizes of megatron-cmp (64 MiB per rank at EP 2) and the Qwen3 proxy (128 MiB)
SHAPES = "megatron_e32_k4_mbs2x8,qwen3_proxy"
CONTENTION = ("{python} -m benchmarks.harness.bench_contention --shapes " + SHAPES
              + " --computes grouped,gemm --iters 20")
HOST = " --moe-a2a-transport host_memory"
PEER = " --moe-a2a-transport peer_memory"
# the GPU tests of each transport (their ids carry [host_memory] / [peer_memory])
TESTS = (" -m gpu tests/parallel/test_host_memory.py tests/benchmarks/test_bench_contention.py"
         " -k ")
HOST_TESTS = "'host_transport or (test_host_memory and not peer and not device_slots)'"
PEER_TESTS = "'peer or device_slots'"
# NCCL's knobs, each the environment of one 2-GPU run (what NCCL 2.28.9 reads: copy_engine.md)
NCCL_KNOBS = {
    "p2p_default": {},
    "p2p_ce": {"NCCL_P2P_USE_CUDA_MEMCPY": "1", "NCCL_CREATE_THREAD_CONTEXT": "1"},
    "shm_default": {"NCCL_P2P_DISABLE": "1"},
    "shm_ce_send": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_USE_CUDA_MEMCPY": "1",
                    "NCCL_SHM_MEMCPY_MODE": "1", "NCCL_CREATE_THREAD_CONTEXT": "1"},
    "shm_ce_both": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_USE_CUDA_MEMCPY": "1",
                    "NCCL_SHM_MEMCPY_MODE": "3", "NCCL_CREATE_THREAD_CONTEXT": "1"},
    "cta_efficiency": {"NCCL_CTA_POLICY": "1"},
    "cta_zero": {"NCCL_CTA_POLICY": "2"},
}
# NCCL's INFO lines say which transport each connection took (`via SHM/CE/CE`, `P2P/.../CE`)
# and which environment settings it read
NCCL_LOG = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,ENV",
            "NCCL_DEBUG_FILE": "{out}/%s/nccl.%%h.%%p.log"}


def _across_gpus(name: str, folder: str, loads: str, timeout_s: int, env: dict = None) -> Step:
    """`bench_contention` under torchrun across the GPUs at both all-to-all sizes: `loads` (its
    --loads and their options) alone and beside the grouped GEMM, into {out}/`folder`."""
    return Step(name, "mkdir -p {out}/" + folder + " && {torchrun} -m "
                "benchmarks.harness.bench_contention --shapes " + SHAPES + " " + loads
                + " --computes grouped --iters 10 --out-dir {out}/" + folder,
                env=dict(env or {}), timeout_s=timeout_s)


def _knob_step(name: str, env: dict) -> Step:
    """NCCL's all-to-all across the GPUs (its default CTAs) alone and beside the GEMMs, under
    one knob's environment, with NCCL's log of what it chose."""
    log = {key: value % name if "%s" in value else value for key, value in NCCL_LOG.items()}
    return _across_gpus(f"nccl_{name}", name, "--loads nccl --max-ctas default", 100,
                        {**env, **log})


def _a2a_round(i: int) -> Step:
    """One round across the GPUs, in one process: NCCL at its default CTAs and at 8, 4 and 2,
    then both copy-engine transports (host memory, peer copies at the bench's 4 MiB slots),
    each alone and beside the grouped GEMM."""
    return _across_gpus(f"a2a_{i}", f"a2a_{i}", "--loads nccl,host_transport,peer_transport "
                        "--max-ctas default,8,4,2", 150)


def _vdev_round(i: int) -> Step:
    """torch's all_to_all_vdev (NVSHMEM kernels) alone and beside the grouped GEMM, a process
    of its own (NVSHMEM's start-up stays out of the other loads' runs)."""
    return _across_gpus(f"symm_vdev_{i}", f"symm_vdev_{i}", "--loads symm_vdev", 100)


STEP_RUN = (TRAIN + " --preset megatron-cmp --mock-data --bf16 --expert-model-parallel-size "
            "{gpus} --train-iters 12 --log-interval 100 --tune off " + GRAPHS)
STEP_SIDES = {"seq": SEQUENTIAL, "seq_host": SEQUENTIAL + HOST, "ovl_wgrad": WGRAD,
              "ovl_wgrad_host": WGRAD + HOST}
# over NVLink the peer copies too (P2P off changes NCCL only: CUDA IPC does not read it)
NVLINK_SIDES = {**STEP_SIDES, "seq_peer": SEQUENTIAL + PEER, "ovl_wgrad_peer": WGRAD + PEER}

COPY_ENGINE_RECIPES = (
    Recipe("copy_transport_1gpu", 1,
           "the copy-engine all-to-alls on one GPU: the GPU tests of host_memory and "
           "peer_memory (two ranks sharing the GPU, control over gloo, exchanges, captured "
           "replays and training losses against gloo's host copies; two ranks' streams in one "
           "process) and their contention with the experts' grouped GEMM "
           "and a dense GEMM at megatron-cmp's and the Qwen3 proxy's all-to-all sizes: each "
           "side alone and beside, GB/s, against a device-to-host copy of the same bytes and "
           "two SM copies (ATen's copy kernel, a copy kernel on every SM and on 16); on one GPU "
           "peer_memory's copies are within the GPU (the `ran as` column says what ran)",
           "junit_host.xml, junit_peer.xml; contention_{1,2,3}/bench_contention.json, three "
           "rounds (every row: ms alone and beside, slowdowns, duty, what the load ran as)",
           (Step("tests_host", TIER + " --junitxml={out}/junit_host.xml" + TESTS + HOST_TESTS,
                 timeout_s=170),
            Step("tests_peer", TIER + " --junitxml={out}/junit_peer.xml" + TESTS + PEER_TESTS,
                 timeout_s=200),
            ) + tuple(Step(f"contention_{i}", CONTENTION + " --loads host_transport,"
                           "peer_transport,d2h_pinned,sm_copy,triton_copy --copy-ctas sms,16 "
                           "--out-dir {out}/contention_" + str(i), timeout_s=170)
                      for i in (1, 2, 3))),
    Recipe("nccl_knobs_2gpu", 2,
           "NCCL's EP all-to-all across 2 GPUs beside the experts' grouped GEMM, alone and "
           "beside (time, GB/s, both sides' slowdowns) under each of its own copy-engine and "
           "CTA knobs (NCCL_P2P_USE_CUDA_MEMCPY, NCCL_SHM_USE_CUDA_MEMCPY with "
           "NCCL_SHM_MEMCPY_MODE 1 and 3 under P2P off, NCCL_CTA_POLICY 1 and 2), one run per "
           "knob with NCCL's log of the transport taken",
           "KNOB/bench_contention.json and KNOB/nccl.*.log for each knob",
           tuple(_knob_step(name, env) for name, env in NCCL_KNOBS.items())),
    Recipe("copy_engine_a2a_2gpu", 2,
           "the EP all-to-all across 2 GPUs beside the experts' grouped GEMM, alone and "
           "beside (time, GB/s, both sides' slowdowns), in 3 rounds: NCCL over NVLink at its "
           "default CTAs and at 8, 4 and 2, the copy-engine transports through host memory "
           "and by peer copies over NVLink (peer_memory) in the same process; then torch's "
           "all_to_all_vdev (NVSHMEM kernels) in a process of its own",
           "a2a_{1,2,3}/, symm_vdev_{1,2,3}/bench_contention.json",
           tuple(step for i in (1, 2, 3) for step in (_a2a_round(i), _vdev_round(i)))),
    Recipe("copy_transport_step_nvlink_2gpu", 2,
           "megatron-cmp's training step over NVLink through NCCL, host memory and "
           "peer_memory's peer copies, sequential and overlapped with delayed wgrads, 3 "
           "interleaved rounds",
           "nvlink/train_rounds.json, nvlink/logs/",
           (rounds_step(NVLINK_SIDES, STEP_RUN, "nvlink", rounds=3, timeout_s=560),)),
    Recipe("copy_transport_step_nop2p_2gpu", 2,
           "megatron-cmp's training step with P2P off (NCCL through host memory) against the "
           "host-memory transport, sequential and overlapped with delayed wgrads, 3 "
           "interleaved rounds",
           "nop2p/train_rounds.json, nop2p/logs/",
           (rounds_step(STEP_SIDES, STEP_RUN, "nop2p", env={"NCCL_P2P_DISABLE": "1"},
                        rounds=3, timeout_s=400),)),
)
