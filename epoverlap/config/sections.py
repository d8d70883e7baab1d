"""The configuration dataclasses, one per concern with orthogonal fields, each field that is a
command-line flag declared as one (`flag`, see config.flags) right here: its name, help,
allowed values and default live beside the field, nowhere else.

`config.run.RunConfig` holds these sections and the values derived from several of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from epoverlap.config.data_text import parse_blend, parse_split
from epoverlap.config.flags import flag
from epoverlap.data.tokenizers import TOKENIZER_TYPES

SCORE_FUNCTIONS = ("softmax", "sigmoid")
ROUTER_DTYPES = ("fp32", "fp64")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
KERNEL_BACKENDS = ("auto", "torch", "triton")
DROP_POLICIES = ("probs", "position")  # as epoverlap.kernels.capacity
DISPATCH_HIERARCHIES = ("auto", "flat", "node")  # --moe-dispatch-hierarchy (config.resolve)
DEVICES = ("auto", "cpu", "cuda")
OVERLAP_PLANS = ("combined_1f1b", "combined_1f1b_early_release", "combined_1f1b_paired_ends")
COMM_MODES = ("real", "local_copy")
A2A_TRANSPORTS = ("process_group", "host_memory", "peer_memory")  # --moe-a2a-transport
COPY_ENGINE_TRANSPORTS = ("host_memory", "peer_memory")  # its transports on copy engines
# --moe-a2a-host-slot-kib's default per transport (benchmarks/copy_engine.md, slot sizes)
COPY_SLOT_KIB = {"process_group": 4096, "host_memory": 4096, "peer_memory": 65536}
CP_COMM_TYPES = ("p2p", "allgather", "a2a", "a2a+p2p")  # Megatron-LM's; model.context: 2
TUNE_MODES = ("auto", "on", "off")
COMM_STREAM_PRIORITIES = ("high", "normal")
NCCL_MAX_CHANNELS = 64  # NCCL's MAXCHANNELS: the most CTAs a collective may use
MAX_SM_CARVEOUT = 64  # the most SMs the grouped GEMMs may leave free (H100/H200 have 132)
DEFAULT_SPLIT = "969,30,1"
LR_DECAY_STYLES = ("constant", "linear", "cosine", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    num_layers: int = flag(2, "transformer layers")
    hidden_size: int = flag(128, "model width")
    ffn_hidden_size: int = flag(256, "dense MLP width")
    num_attention_heads: int = flag(4, "query heads")
    num_query_groups: Optional[int] = flag(None, "key/value heads (GQA)")
    kv_channels: Optional[int] = flag(None, "each head's width (none: --hidden-size / "
                                      "--num-attention-heads); Qwen3 sets it wider")
    seq_length: int = flag(128, "tokens per sequence")
    vocab_size: int = 256  # not a flag: the data's tokenizer sets it (cli.train); 256 = bytes
    make_vocab_size_divisible_by: int = flag(
        128, "the embedding and output layer get the vocabulary rounded up to a multiple of N "
        "rows, so the logit GEMMs run on aligned tensor-core kernels; the padding rows start "
        "at zero, are never looked up and are left out of the softmax (the loss is the "
        "unpadded model's). Megatron-LM's flag and default (it multiplies N by the tensor-"
        "parallel size, 1 here)", metavar="N")
    rotary_base: float = flag(10000.0, "rotary embedding base")
    norm_epsilon: float = flag(1e-5, "RMSNorm epsilon")
    qk_layernorm: bool = flag(
        False, "RMSNorm over each head's query and key before rotary, one weight [head dim] "
        "each, shared by the heads (Megatron-core's q_layernorm / k_layernorm; Qwen3)")
    init_method_std: float = flag(0.02, "weight init std")
    attention_dropout: float = flag(
        0.0, "dropout on the attention probabilities in training (Megatron-LM's default is "
        "0.1; MoE recipes set 0)")
    hidden_dropout: float = flag(
        0.0, "dropout on the attention and MLP outputs before each residual add, in training "
        "(Megatron-LM's default is 0.1; MoE recipes set 0)")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """The embedding's and head's rows (decided here only): vocab_size rounded up."""
        multiple = max(1, self.make_vocab_size_divisible_by)  # < 1 is refused by validation
        return -(-self.vocab_size // multiple) * multiple


@dataclass(kw_only=True, frozen=True)
class MoEConfig:
    num_experts: Optional[int] = flag(8, "routed experts (0/none: dense model)")
    moe_router_topk: int = flag(2, "experts per token")
    moe_ffn_hidden_size: Optional[int] = flag(None, "expert FFN width (none: --ffn-hidden-size)")
    moe_shared_expert_intermediate_size: Optional[int] = flag(
        None, "shared expert FFN width (none: no shared expert)")
    moe_router_score_function: str = flag("softmax", "router score function",
                                          choices=SCORE_FUNCTIONS)
    moe_router_pre_softmax: bool = flag(False, "softmax before top-k")
    moe_router_num_groups: Optional[int] = flag(None, "expert groups")
    moe_router_group_topk: Optional[int] = flag(None, "groups kept")
    moe_router_topk_scaling_factor: Optional[float] = flag(None, "multiplies routing probs")
    moe_router_enable_expert_bias: bool = flag(False, "aux-loss-free expert bias (sigmoid)")
    moe_router_bias_update_rate: float = flag(1e-3, "expert bias step per iteration")
    moe_aux_loss_coeff: float = flag(0.0, "Switch aux loss coefficient")
    moe_router_load_balancing_type: str = flag(
        "aux_loss", "what --moe-aux-loss-coeff weighs: the Switch loss over each microbatch "
        "(aux_loss) or averaged over its sequences (seq_aux_loss, DeepSeek-V3's), or no loss "
        "(none)", choices=LOAD_BALANCING_TYPES)
    moe_z_loss_coeff: Optional[float] = flag(None, "router z-loss coefficient")
    moe_router_dtype: Optional[str] = flag(None, "router gate dtype (none: the model's)",
                                           choices=ROUTER_DTYPES)
    moe_layer_freq: str = flag("1", "every N-th layer is MoE, or a 0/1 list like 0,1,1,1 or "
                               "Megatron-LM's ([0]*1+[1]*3)", metavar="FREQ")
    moe_first_k_dense_replace: int = flag(0, "first k layers dense")
    moe_router_force_load_balancing: bool = flag(
        False, "benchmark only: random router logits (balanced routing)")
    moe_expert_capacity_factor: Optional[float] = flag(
        None, "expert capacity = ceil(tokens x topk / experts x FACTOR); routed tokens over it "
        "are dropped and counted (Megatron-core semantics; negative or none: dropless)")
    moe_pad_expert_input_to_capacity: bool = flag(
        False, "pad every expert's input to the capacity: static all-to-all sizes, no host sync")
    moe_token_drop_policy: str = flag("probs", "which tokens an expert over capacity keeps",
                                      choices=DROP_POLICIES)
    moe_dispatch_budget: Optional[float] = flag(
        None, "dropless without a host sync: fixed all-to-all buffers of FACTOR x the balanced "
        "rows per rank; a step that overflows them is rerun with a larger budget")
    moe_dispatch_budget_memory: int = flag(
        0, "with --moe-dispatch-budget: each step starts at the largest budget level one of the "
        "last N steps ended at, so a router that keeps overflowing the base budget is not rerun "
        "every step (the levels are saved in checkpoints: a resumed run starts where the saved "
        "one would have); 0: every step starts at the base budget")
    moe_dispatch_budget_fit: bool = flag(
        False, "with --moe-dispatch-budget: the base budget follows the demand, so the fixed "
        "buffers move about the dropless dispatch's bytes: after the first step it becomes the "
        "most rows to one rank of the last --moe-dispatch-budget-memory steps (at least 1), "
        "plus 2%%; it grows after a step that overflowed it and shrinks at most every 100 "
        "steps, recapturing the CUDA graphs that hold the dispatch (saved in checkpoints)")
    moe_dispatch_once_per_rank: bool = flag(
        False, "send each token once to every EP rank that holds one of its top-k experts (not "
        "once per expert), with the probs of that rank's experts; the receiving rank copies it "
        "to them and sums their outputs before the combine sends one row back. All-to-all "
        "volume / up to min(topk, EP); the experts' rows and grads are the same, the combined "
        "output is summed per rank first (another rounding order). Dropless, capacity "
        "(unpadded) and budget dispatches")
    moe_dispatch_hierarchy: str = flag(
        "auto", "node: each token crosses between hosts once per destination host (to the rank "
        "with its own index in that host), with the probs of that host's experts, and is "
        "forwarded inside the host to the ranks holding its experts; the combine sums inside "
        "the host first and crosses back once. Needs an expert-parallel group of whole hosts, "
        "at least two (torchrun's nodes, or --emulate-hosts), and the dropless or capacity "
        "(unpadded) dispatch. The experts' rows and grads are those of "
        "--moe-dispatch-once-per-rank; the combined output is summed per host first (another "
        "rounding order). flat: one all-to-all over the whole group",
        choices=DISPATCH_HIERARCHIES,
        default_text="auto: node where the expert-parallel group spans two or more whole "
        "hosts and, routing balanced, it sends at most 0.8 of flat's rows between them; else "
        "flat")

    @property
    def enabled(self) -> bool:
        return bool(self.num_experts)

    @property
    def capacity_factor(self) -> Optional[float]:
        """The capacity factor in force: None when unset or negative (dropless)."""
        factor = self.moe_expert_capacity_factor
        return None if factor is None or factor < 0 else factor


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    expert_model_parallel_size: Optional[int] = flag(
        None, "EP size: experts are sharded over EP ranks and replicated over world/EP (EDP) "
        "ranks; dense layers are data-parallel over the stage's DP ranks",
        default_text="auto: every rank of a pipeline stage, or the largest size dividing both "
        "them and the experts; 1 for a dense model")
    pipeline_model_parallel_size: int = flag(
        1, "PP size: pipeline stages (1F1B schedule; ranks laid out as Megatron-core's "
        "tp-cp-ep-dp-pp)")
    context_parallel_size: int = flag(
        1, "CP size: each sequence is cut into 2 x CP chunks, rank i of a CP group holding "
        "chunks i and 2CP-1-i (the causal load balance), and attention exchanges keys and "
        "values over the group (--cp-comm-type); dense grads are averaged over CP x DP ranks, "
        "the EP groups span a stage's ranks as Megatron-core's do")
    cp_comm_type: tuple[str, ...] = flag(
        ("p2p",), "how attention exchanges keys and values over the CP ranks: p2p (a ring of "
        "CP - 1 point-to-point steps, each step's partial attention merged by its log-sum-exp) "
        "or allgather (every rank's keys and values gathered, then one attention per local "
        "chunk); one value for every layer, or one per layer", choices=CP_COMM_TYPES,
        why="a2a and a2a+p2p split heads over the CP ranks by an all-to-all; not implemented",
        metavar="TYPE")
    dynamic_context_parallel: bool = flag(
        False, "dynamic CP: each microbatch runs at the smallest CP size of the set (powers of "
        "2 from --min-dynamic-context-parallel-size to --context-parallel-size) whose segments "
        "of size x S/CP tokens hold whole documents of every sequence; the CP group then splits "
        "into CP/size groups of size ranks, each taking one segment (no rank idles, every token "
        "is computed once); needs --reset-attention-mask; the groups of every size are made at "
        "start")
    min_dynamic_context_parallel_size: int = flag(
        1, "the smallest CP size dynamic CP chooses (a power of 2, at most "
        "--context-parallel-size)")
    max_seqlen_per_dp_cp_rank: Optional[int] = flag(
        None, "tokens of a sequence per rank under dynamic CP: every rank holds S/CP tokens at "
        "every size, so when given it must be --seq-length / --context-parallel-size",
        default_text="--seq-length / --context-parallel-size")
    num_layers_per_virtual_pipeline_stage: Optional[int] = flag(
        None, "layers per model chunk: interleaved 1F1B with layers / (PP x this) chunks per "
        "stage")
    num_virtual_stages_per_pipeline_rank: Optional[int] = flag(
        None, "model chunks per stage (interleaved 1F1B); the newer form of the flag above")
    distributed_timeout_minutes: float = flag(
        10.0, "collective timeout of every process group: a peer rank that does not answer for "
        "this long ends the job, naming it (fractions allowed, >= 0.05)")
    emulate_hosts: int = flag(
        1, "tests and benchmarks on one machine: split its ranks into N emulated hosts of "
        "LOCAL_WORLD_SIZE / N consecutive local ranks, each with its own NCCL host identity "
        "(NCCL_HOSTID), so NCCL connects ranks of two emulated hosts over its network "
        "transport and ranks of one over NVLink or host memory, as between real hosts; on "
        "gloo it only says which ranks share a host (--moe-dispatch-hierarchy, the lost-host "
        "line) (1: off)", metavar="N")
    nccl_transport_report: Optional[bool] = flag(
        None, "after the first step, print which transport NCCL chose between which ranks, "
        "read from NCCL's own INFO log (NCCL_DEBUG=INFO into a file per rank; not when "
        "NCCL_DEBUG is already set); with --emulate-hosts the job fails when two emulated "
        "hosts talk over anything but NCCL's network transport",
        default_text="auto: on with --emulate-hosts > 1 on CUDA")
    moe_a2a_nccl_max_ctas: Optional[int] = flag(
        None, f"NCCL: at most N CTAs (SMs) for each all-to-all of the expert-parallel group "
        f"(its communicator's max_ctas, 1..{NCCL_MAX_CHANNELS}; none: NCCL's choice); other "
        "groups keep NCCL's defaults")
    moe_a2a_nccl_min_ctas: Optional[int] = flag(
        None, f"NCCL: at least N CTAs for each all-to-all of the expert-parallel group "
        f"(min_ctas, 1..{NCCL_MAX_CHANNELS}, <= the max)")
    moe_a2a_transport: str = flag(
        "process_group", "what carries the bytes of the expert-parallel all-to-alls: "
        "process_group (NCCL's kernels on GPUs, gloo on CPU); host_memory (a pinned buffer "
        "in shared host memory, filled and drained by the copy engines, ordered by stream "
        "memory operations: no SM kernel, so it takes no SMs from the experts' GEMMs beside "
        "it; at PCIe's bandwidth, not NVLink's); peer_memory (the same on copy engines, "
        "but each chunk copied straight into the receiving GPU's memory, opened through "
        "CUDA IPC: a peer copy over NVLink between GPUs). The "
        "same bits either way, eager or in CUDA graphs. host_memory and peer_memory need the "
        "expert-parallel group on one host and the flat dispatch; with --tune the process "
        "group's all-to-all is timed as one more path (`+group`)",
        choices=A2A_TRANSPORTS, metavar="KIND")
    moe_a2a_host_slot_kib: Optional[int] = flag(
        None, "--moe-a2a-transport host_memory or peer_memory: the slot size (default: "
        f"{COPY_SLOT_KIB['host_memory']} for host_memory, {COPY_SLOT_KIB['peer_memory']} for "
        "peer_memory: peer copies over NVLink need large pieces, host memory's PCIe copies do "
        "not); each pair of "
        "ranks has two slots of N KiB (host_memory: ranks^2 x 2 x N KiB of pinned host memory "
        "per host; peer_memory: ranks x 2 x N KiB of each rank's device memory), so a "
        "message moves in pieces of N KiB and one piece is copied in while the one before is "
        "copied out", metavar="N")
    moe_grouped_gemm_sm_carveout: Optional[int] = flag(
        None, "CUDA: the experts' grouped GEMMs run on all SMs but N (torch's SM carveout), "
        "leaving N free for the all-to-all kernels that run beside them under "
        "--overlap-moe-expert-parallel-comm; pair it with --moe-a2a-nccl-max-ctas N. The "
        "persistent grouped GEMM otherwise holds every SM: an all-to-all started beside it "
        "waits for SMs, and its last CTAs wait for the all-to-all. Same bits (each output tile "
        "is still one CTA's full-K sum); none: every SM")


    def transport_report(self, on_gpu: bool) -> bool:
        """--nccl-transport-report, or its auto value: on with emulated hosts on NCCL."""
        if self.nccl_transport_report is None:
            return on_gpu and self.emulate_hosts > 1
        return self.nccl_transport_report


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    micro_batch_size: int = flag(2, "sequences per microbatch")
    num_microbatches: int = flag(4, "microbatches per step")
    global_batch_size: Optional[int] = flag(
        None, "sequences per step over all ranks (Megatron's form): sets --num-microbatches to "
        "it / (--micro-batch-size x data-parallel ranks)")
    train_iters: int = flag(20, "optimizer steps")
    train_samples: Optional[int] = flag(
        None, "sequences to train on, instead of --train-iters: steps = this / global batch")
    lr: float = flag(3e-3, "peak learning rate")
    min_lr: float = flag(3e-4, "final learning rate")
    lr_warmup_iters: int = flag(2, "linear warmup steps")
    lr_warmup_fraction: Optional[float] = flag(
        None, "warmup as a fraction of the decay steps, instead of --lr-warmup-iters")
    lr_warmup_init: float = flag(0.0, "the learning rate the warmup starts from")
    lr_warmup_samples: Optional[int] = flag(
        None, "with --train-samples: the warmup in sequences, instead of --lr-warmup-iters "
        "(the schedule runs on sequences trained, step x global batch, as Megatron-LM's)")
    lr_decay_samples: Optional[int] = flag(
        None, "with --train-samples: the decay's end in sequences, instead of "
        "--lr-decay-iters")
    samples_per_step: Optional[int] = None  # not a flag: the global batch (for_world)
    lr_decay_style: str = flag(
        "cosine", "from the peak to --min-lr after the warmup (Megatron-LM's default is "
        "linear)", choices=LR_DECAY_STYLES)
    lr_decay_iters: Optional[int] = flag(
        None, "the step the decay ends at, counted from step 0 (none: --train-iters)")
    lr_wsd_decay_style: str = flag("exponential", "WSD: the shape of its final decay",
                                   choices=WSD_DECAY_STYLES)
    lr_wsd_decay_iters: Optional[int] = flag(
        None, "WSD: the steps of its final decay, ending at --lr-decay-iters (none: all of "
        "them after the warmup)")
    weight_decay: float = flag(0.01, "AdamW weight decay")
    adam_beta1: float = flag(0.9, "AdamW beta1")
    adam_beta2: float = flag(0.95, "AdamW beta2")
    adam_eps: float = flag(1e-8, "AdamW epsilon")
    clip_grad: float = flag(1.0, "global grad-norm clip (0: off)")
    seed: int = flag(1234, "random seed")
    bf16: Optional[bool] = flag(None, "bf16 params and compute (also on CPU)",
                                default_text="auto: on CUDA devices, off on CPU")
    deterministic_mode: bool = flag(False, "deterministic algorithms")
    deterministic_fill_uninitialized_memory: bool = flag(
        False, "with --deterministic-mode: also fill every new tensor's memory (NaN, or the "
        "largest integer) before use, torch's check that no result reads memory nothing "
        "wrote; one more kernel per allocation. Off: the results are the same bits (tested), "
        "at a lower price")
    device: str = flag("auto", "where the ranks run (auto: CUDA when visible)", choices=DEVICES)
    skip_optimizer_step: bool = flag(
        False, "benchmark only: forward+backward+grad reduce, no update")
    check_for_nan_in_loss_and_grad: bool = flag(
        False, "stop at a NaN/Inf loss or grad (before the optimizer step), naming rank and "
        "parameter", negatable=True)
    no_gradient_accumulation_fusion: bool = flag(
        False, "weight-grad GEMMs (dense and the experts' grouped ones) write their product, "
        "which is then added to the fp32 main_grad, instead of adding into main_grad inside "
        "the GEMM (one GEMM and one add kernel per weight and microbatch); the norms' and the "
        "embedding's grads are likewise added after their backward")
    exit_signal_handler: bool = flag(
        False, "on SIGTERM or SIGINT, save a checkpoint (--save) of the last finished step "
        "before exiting")
    exit_duration_in_mins: Optional[float] = flag(
        None, "stop after this many minutes of training (the step in progress finishes), "
        "saving a checkpoint with --save")
    exit_interval: Optional[int] = flag(
        None, "stop after the step whose number is a multiple of N, saving a checkpoint with "
        "--save")
    manual_gc: bool = flag(False, "Python's garbage collector runs only every "
                           "--manual-gc-interval steps, between steps (not mid-step)")
    manual_gc_interval: int = flag(0, "with --manual-gc: steps between collections (0: only "
                                   "at the start)")

    @property
    def decay_steps(self) -> float:
        """The step the learning-rate decay ends at (from step 0); given in sequences, a
        fraction of a step where the global batch does not divide them (Megatron-LM's
        schedule on sequences trained)."""
        if self.lr_decay_samples is not None and self.samples_per_step:
            return self.lr_decay_samples / self.samples_per_step
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.train_iters

    @property
    def warmup_steps(self) -> float:
        """Warmup steps: --lr-warmup-fraction of the decay steps, else --lr-warmup-samples
        over the global batch, else --lr-warmup-iters."""
        if self.lr_warmup_fraction is not None:
            return int(self.lr_warmup_fraction * self.decay_steps)
        if self.lr_warmup_samples is not None and self.samples_per_step:
            return self.lr_warmup_samples / self.samples_per_step
        return self.lr_warmup_iters


@dataclass(kw_only=True, frozen=True)
class EvalConfig:
    eval_interval: Optional[int] = flag(
        None, "every N steps (and after the last), the loss on validation data: the --split "
        "valid part of --data-path, or fresh --mock-data (none: no evaluation)")
    eval_iters: int = flag(100, "global batches each evaluation reads")


@dataclass(kw_only=True, frozen=True)
class OverlapConfig:
    overlap_moe_expert_parallel_comm: Optional[bool] = flag(
        None, "combined 1F1B schedule hiding EP all-to-all",
        default_text="auto: on with EP > 1 and MoE layers")
    delay_wgrad_compute: bool = flag(
        False, "split weight grads out and run them in the comm gaps")
    overlap_grad_reduce: bool = flag(
        False, "all-reduce each layer's grads over the data-parallel replicas on the comm lane as "
        "soon as the step's last backward and delayed weight grad of the layer are done, beside "
        "the rest of the backward, instead of all after it; the same bits either way (the same "
        "buckets in the same order). Pays where the comm lane idles during the backward; where "
        "the all-to-alls bind it delays them. Not with --cuda-graph-impl full_iteration")
    overlap_plan: Optional[str] = flag(
        None, "the combined 1F1B (F0 alone, F(i) beside B(i-1), B(M-1) alone); its "
        "early_release form (B.attn before F.mlp, for memory); paired_ends (F0 beside F1 and "
        "B(M-2) beside B(M-1): the ends overlap too, for one microbatch's activations more; "
        "one pipeline stage)", choices=OVERLAP_PLANS,
        default_text="combined_1f1b; not given, --tune may pick paired_ends")
    moe_a2a_waves: int = flag(
        1, "split each MoE layer's local experts into K waves, each with its own all-to-alls: "
        "the dispatch of wave i+1 and the combine of wave i-1 run while the experts compute "
        "wave i, forward and backward, inside one microbatch (the edges of the combined 1F1B "
        "and the sequential schedule have no partner microbatch to hide behind); the same "
        "bits as K = 1. Dropless, capacity or budget dispatch, at most the local expert count",
        metavar="K", old_name="--moe-a2a-chunks")
    comm_stream_priority: str = flag(
        "high", "CUDA priority of the overlap's comm stream (its all-to-alls run there); high "
        "lets their kernels start ahead of waiting compute kernels",
        choices=COMM_STREAM_PRIORITIES)
    # Not flags: the benchmark harness's stand-in for the all-to-alls
    # (`python -m benchmarks.harness.train_bench --comm-mode local_copy [--local-copy-hold-us
    # N]`). local_copy replaces each all-to-all by a local copy of its bytes (the compute-only
    # step); a hold keeps the comm lane busy N us after each copy, as a real all-to-all would
    # (GPU: a sleep kernel on the lane's stream; CPU: the lane's thread sleeps), so the host
    # queues the compute behind it and the compute spans time the device's work.
    comm_mode: str = "real"  # COMM_MODES
    local_copy_hold_us: int = 0  # 0: no hold
    overlap_probe_steps: int = flag(
        0, "deprecated: --tune on --tune-steps N over two paths only, the overlap plan and the "
        "sequential schedule; 0: not given")
    tune: str = flag(
        "auto", "after the first step (and each path's CUDA graph capture), time the paths the "
        "run can switch between without changing its bits (the overlap plans, each with "
        "delayed weight grads off and on, and the sequential schedule; axes pinned by "
        "--overlap-plan or --delay-wgrad-compute are not tuned), round-robin, on the slowest "
        "rank, and train on with the fastest median; the tuning steps train as usual. auto: "
        "on CUDA devices with the overlap, one pipeline stage and steps enough; off: the "
        "flags' path", choices=TUNE_MODES, metavar="MODE")
    tune_steps: int = flag(3, "timed steps of each path (their median decides)")
    tune_allow_rounding: bool = flag(
        False, "let the tuner also time a path whose results round apart from the flags' "
        "(the dispatch once per rank, --moe-dispatch-once-per-rank: fewer bytes, its combine "
        "sums per rank first); a run that takes it differs from an untuned run in the last "
        "bits, and a rerun from --tune-cache reproduces it")
    tune_cache: Optional[str] = flag(
        None, "a folder of tuning decisions: a run of the same shape, flags, GPUs, link and "
        "versions takes the decision from DIR/<key>.json and skips tuning (none: no cache)",
        metavar="DIR")

    @property
    def comm_stream_high_priority(self) -> bool:
        return self.comm_stream_priority == "high"

    @property
    def overlap_plan_name(self) -> str:
        """--overlap-plan, or combined_1f1b when not given."""
        return self.overlap_plan or OVERLAP_PLANS[0]


@dataclass(kw_only=True, frozen=True)
class KernelConfig:
    kernel_backend: str = flag("auto", "routing, norm and loss kernels (auto: triton on CUDA, "
                               "torch on CPU)", choices=KERNEL_BACKENDS)


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """One source: raw text (`data`, byte tokens; the default, Python's own sources), Megatron
    indexed datasets (`data_path`, read through a tokenizer's vocabulary) or `mock_data`."""

    data: Optional[str] = flag(
        None, "raw text file or folder read as byte tokens, or 'stdlib' (Python's own sources; "
        "the default when no --data-path or --mock-data is given)", metavar="PATH")
    data_path: tuple[str, ...] = flag(
        (), "Megatron indexed datasets: PREFIX [PREFIX ...] or WEIGHT PREFIX [WEIGHT PREFIX "
        "...] (PREFIX.bin + PREFIX.idx; epoverlap-convert-data writes them)", metavar="PREFIX")
    split: Optional[str] = flag(
        None, "train,valid,test proportions of each --data-path dataset's documents; training "
        "reads the train part", default_text=DEFAULT_SPLIT, metavar="TRAIN,VALID,TEST")
    mock_data: bool = flag(False, "synthetic tokens (a learnable random bigram chain) instead "
                           "of data")
    tokenizer_type: Optional[str] = flag(None, "the vocabulary of --data-path / --mock-data "
                                         "(none with --vocab-file: GPT2BPETokenizer, as "
                                         "Megatron-LM's tests use it)", choices=TOKENIZER_TYPES)
    tokenizer_model: Optional[str] = flag(
        None, "HuggingFaceTokenizer: a tokenizer.json or a folder holding one; Llama2Tokenizer: "
        "a SentencePiece tokenizer.model", metavar="PATH")
    vocab_file: Optional[str] = flag(None, "GPT2BPETokenizer: its vocab.json", metavar="PATH")
    merge_file: Optional[str] = flag(None, "GPT2BPETokenizer: its merges.txt", metavar="PATH")
    vocab_size: Optional[int] = flag(
        None, "NullTokenizer: ids 0..N-1 (the model's vocabulary is N + 1, with "
        "end-of-document N)")
    eod_mask_loss: bool = flag(
        False, "the loss leaves out the prediction made at each end-of-document token (of the "
        "next document's first token), as Megatron-LM's; --data-path datasets")
    reset_position_ids: bool = flag(
        False, "positions restart after each end-of-document token (the rotary angles of each "
        "document of a packed sample start at 0), as Megatron-LM's; --data-path datasets")
    reset_attention_mask: bool = flag(
        False, "attention stays inside each document of a packed sample (a token sees the "
        "earlier tokens of its own document only), as Megatron-LM's; --data-path datasets")
    max_documents_per_sample: int = flag(
        64, "with --reset-attention-mask: the most documents one sample may hold (on GPUs the "
        "variable-length attention's document table has this many entries, one shape every "
        "step, so CUDA graphs hold it and no step waits on the host); a sample with more "
        "stops the run naming this flag", metavar="N")

    @property
    def reads_documents(self) -> bool:  # the model needs the samples' document ends
        return self.reset_position_ids or self.reset_attention_mask

    @property
    def tokenizer(self) -> Optional[str]:
        """The tokenizer type the run reads its vocabulary with (--tokenizer-type's default)."""
        return self.tokenizer_type or ("GPT2BPETokenizer" if self.vocab_file else None)

    @property
    def text_source(self) -> Optional[str]:
        """The raw-text source when neither --data-path nor --mock-data is given."""
        if self.data_path or self.mock_data:
            return None
        return self.data or "stdlib"

    @property
    def blend(self) -> tuple[list[str], Optional[list[float]]]:
        return parse_blend(self.data_path)

    @property
    def split_fractions(self) -> tuple[float, float, float]:
        return parse_split(self.split or DEFAULT_SPLIT)


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    save: Optional[str] = flag(
        None, "checkpoint folder (DIR/iter_NNNNNNN, torch.distributed.checkpoint; shared by all "
        "ranks)", metavar="DIR")
    save_interval: Optional[int] = flag(
        None, "save every N steps (and after the last); without it, only after the last")
    load: Optional[str] = flag(
        None, "resume from the newest complete checkpoint in DIR (or from DIR itself); any EP "
        "size", metavar="DIR")
    no_load_optim: bool = flag(False, "with --load: start the optimizer afresh (moments 0)")
    no_load_rng: bool = flag(False, "with --load: take random state from --seed, not the "
                             "checkpoint")
    finetune: bool = flag(False, "with --load: load the weights only and start at step 1 (no "
                          "optimizer state, random state or step count from the checkpoint)")


@dataclass(kw_only=True, frozen=True)
class LogConfig:
    log_interval: int = flag(1, "steps between log lines")
    log_json: Optional[str] = flag(None, "write one JSON record per step here", metavar="FILE")
    profile_steps: Optional[str] = flag(None, "steps to record spans for", metavar="START:END")
    profile_dir: Optional[str] = flag(None, "where span files go", metavar="DIR")
    use_pytorch_profiler: bool = flag(
        False, "also capture torch.profiler traces of the --profile-steps")
    tensorboard_dir: Optional[str] = flag(
        None, "write TensorBoard scalars here (needs the 'tensorboard' extra)", metavar="DIR")
    wandb_project: Optional[str] = flag(
        None, "also log the step scalars to this Weights & Biases project (needs the 'wandb' "
        "extra; offline unless WANDB_API_KEY is set)")
    wandb_exp_name: Optional[str] = flag(None, "the W&B run's name")
    wandb_save_dir: Optional[str] = flag(None, "where W&B keeps its files (default: beside "
                                         "--log-json, --save or the working folder)",
                                         metavar="DIR")
    log_dir: Optional[str] = flag(
        None, "each rank writes everything it prints to DIR/rank-NNNNN.log too (rank 0 also "
        "prints to the terminal)", metavar="DIR")

    @property
    def profile_range(self) -> Optional[tuple[int, int]]:
        if self.profile_steps is None:
            return None
        start, end = self.profile_steps.split(":")
        return int(start), int(end)
