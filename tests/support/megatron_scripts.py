"""Megatron-LM's MoE command lines kept in tests/fixtures/megatron_scripts, read as argument
lists, and the rule that shrinks them for 2 CPU ranks.

The fixtures are Megatron-LM's own files from its main branch, verbatim below a header naming
the source path and commit (`*.sh`), and the EP-overlap functional test's YAML written as one
flag a line (`*.args`). A `.sh` file's arguments are what bash gives `pretrain_gpt.py` when the
script runs (`script_args`): the script is sourced in bash with `torchrun`, `sbatch`, `srun` and
`mkdir` as stubs, and its argument variable printed; its shell variables (paths) come from the
caller.

`shrunk` is the one rule a test may apply: sizes and run lengths (SIZES), parallel sizes so
that the job fits 2 ranks, and paths. Every other flag and value stays as the script has it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional

SCRIPTS = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_scripts"
MIXTRAL = "train_mixtral_8x7b_distributed.sh"
QWEN3 = "Qwen3-30B-A3B.sh"
DEEPSEEK_V3 = "sbatch_mfsdp_deepseek_v3.sh"
DEEPSEEK_V2_LITE = "DeepSeek-V2-Lite.sh"
EP_OVERLAP = "deepseek_proxy_ep_overlap.args"  # Megatron-LM's EP-overlap functional test
NAMES = (MIXTRAL, QWEN3, DEEPSEEK_V3, DEEPSEEK_V2_LITE, EP_OVERLAP)
MODEL_ARGS_ONLY = (QWEN3, DEEPSEEK_V2_LITE)  # a model's arguments: the caller adds the rest

# What bash prints after sourcing each script: the arguments its pretrain_gpt.py gets.
_PRINT = {MIXTRAL: "",  # the torchrun stub prints them
          QWEN3: "printf '%s\\n' $MODEL_ARGS", DEEPSEEK_V2_LITE: "printf '%s\\n' $MODEL_ARGS",
          DEEPSEEK_V3: "printf '%s\\n' \"${PRETRAIN_ARGS[@]}\""}
_STUBS = ("torchrun() { while [ \"$1\" != pretrain_gpt.py ]; do shift; done; shift; "
          "printf '%s\\n' \"$@\" >&3; }; sbatch() { cat >/dev/null; }; srun() { :; }; "
          "mkdir() { :; }")
HEADER_END = "# END OF FIXTURE HEADER\n"


def script_text(name: str) -> str:
    """The fixture as Megatron-LM has it (below the header)."""
    text = (SCRIPTS / name).read_text()
    return text.split(HEADER_END, 1)[1] if HEADER_END in text else text


def script_args(name: str, variables: Optional[dict[str, str]] = None,
                positional: tuple[str, ...] = (), cwd: Optional[Path] = None) -> list[str]:
    """The arguments `name` gives pretrain_gpt.py, with `variables` in its environment (unset
    ones expand as bash expands them: empty, or the script's default)."""
    if name.endswith(".args"):
        args = [token for line in (SCRIPTS / name).read_text().splitlines()
                if line.strip() and not line.startswith("#") for token in line.split()]
        for key, value in (variables or {}).items():
            args = [arg.replace("${" + key + "}", value) for arg in args]
        return args
    script = SCRIPTS / name
    command = f"{_STUBS}; source {script} \"$@\" 3>&1 >/dev/null; {_PRINT[name]}"
    env = {"PATH": "/usr/bin:/bin", **(variables or {})}
    out = subprocess.run(["bash", "-c", command, "bash", *positional], env=env, cwd=cwd,
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def flag_values(args: list[str]) -> list[list[str]]:
    """The arguments grouped as [flag, value, ...] per flag."""
    groups: list[list[str]] = []
    for token in args:
        if token.startswith("--"):
            groups.append([token])
        else:
            groups[-1].append(token)
    return groups


# The rule: these flags' values, whatever the script gives; each only where the script gives
# it. Run lengths in steps and samples; widths small enough for a CPU step in well under a
# second. --num-layers is 2 per pipeline stage (kept where --moe-layer-freq lists each layer).
SIZES = {"--hidden-size": "64", "--ffn-hidden-size": "128", "--moe-ffn-hidden-size": "32",
         "--moe-shared-expert-intermediate-size": "32", "--num-attention-heads": "4",
         "--num-query-groups": "2", "--seq-length": "32", "--train-iters": "6",
         "--lr-decay-iters": "6", "--lr-warmup-iters": "1", "--eval-interval": "3",
         "--eval-iters": "1", "--save-interval": "3"}
HEAD_WIDTH = 16  # --hidden-size / --num-attention-heads after SIZES
EXPERTS = 16  # --num-experts above it become 16 (every script's top-k and groups still fit)
RANKS = 2


def shrunk(args: list[str]) -> list[str]:
    """`args` by the rule (module docstring): SIZES; --num-experts at most EXPERTS;
    --kv-channels the shrunk head width, or twice it where the script's is not its hidden /
    heads; --global-batch-size 4 micro batches, --train-samples (and the samples' schedule)
    6 global batches; --pipeline-model-parallel-size at most 2 and
    --expert-model-parallel-size the rest of the 2 ranks; --num-layers 2 per stage."""
    groups = flag_values(args)
    given = {group[0]: group[1:] for group in groups}
    pp = min(int(_one(given, "--pipeline-model-parallel-size", "1")), RANKS)
    micro = int(_one(given, "--micro-batch-size", "1"))
    listed = "," in _one(given, "--moe-layer-freq", "1") or "[" in _one(given,
                                                                        "--moe-layer-freq", "1")
    head = int(_one(given, "--hidden-size", "1")) // int(_one(given, "--num-attention-heads",
                                                              "1"))
    values = dict(SIZES)
    values.update({"--global-batch-size": str(4 * micro), "--train-samples": str(24 * micro),
                   "--lr-decay-samples": str(24 * micro), "--lr-warmup-samples": str(4 * micro),
                   "--pipeline-model-parallel-size": str(pp),
                   "--expert-model-parallel-size": str(RANKS // pp)})
    if not listed:
        values["--num-layers"] = str(2 * pp)
    if "--num-experts" in given:
        values["--num-experts"] = str(min(int(given["--num-experts"][0]), EXPERTS))
    if "--kv-channels" in given:
        same = int(given["--kv-channels"][0]) == head
        values["--kv-channels"] = str(HEAD_WIDTH if same else 2 * HEAD_WIDTH)
    return [token for group in groups
            for token in ([group[0], values[group[0]]] if group[0] in values and len(group) == 2
                          else group)]


def _one(given: dict[str, list[str]], flag: str, default: str) -> str:
    return given[flag][0] if given.get(flag) else default


# The rule's paths, under a run's folder ROOT: the scripts' shell variables, Mixtral's
# positional arguments (checkpoint, tokenizer model, data) and, for a model's arguments only,
# the run the caller adds (its tokenizer model, data and length).
VOCAB = 256  # every tokenizer written below has this vocabulary (GPT-2's: 257)
DOCUMENTS, DOCUMENT_TOKENS = 25_000, 40  # --split 99990,8,2's valid part: 2 documents


def variables(root: Path) -> dict[str, str]:
    return {"DATA_PATH": str(root / "data"), "OUTPUT_PATH": str(root / "out"),
            "TENSORBOARD_PATH": str(root / "tb"), "DATA_CACHE_PATH": str(root / "cache")}


def pasted(name: str, root: Path = Path(".")) -> list[str]:
    """`name`'s arguments with the rule's paths under `root`, shrunk by the rule."""
    args = script_args(name, variables(root), (str(root / "ckpt"), str(root / "tokenizer.model"),
                                               str(root / "data" / "text")))
    run = (["--tokenizer-model", str(root / "tokenizer.json"), "--data-path",
            str(root / "data" / "text"), "--train-iters", SIZES["--train-iters"]]
           if name in MODEL_ARGS_ONLY else [])
    return shrunk(args) + run


def write_run_files(root: Path) -> None:
    """The data and tokenizer files the rule's paths name: one indexed dataset of DOCUMENTS
    documents of DOCUMENT_TOKENS ids below VOCAB (at `data/text` and where the EP-overlap
    config's ${DATA_PATH} puts it), a SentencePiece tokenizer.model, a Hugging Face
    tokenizer.json and GPT-2 vocab.json / merges.txt, each of vocabulary VOCAB (GPT-2's
    with <|endoftext|>)."""
    import json
    import numpy as np
    from epoverlap.data.indexed import IndexedWriter
    tokens = np.random.default_rng(0).integers(0, VOCAB, (DOCUMENTS, DOCUMENT_TOKENS))
    pile = root / "data" / "text" / "the_pile" / "shard00"
    for prefix in (root / "data" / "text", pile / "my-gpt3_00_text_document"):
        with IndexedWriter(str(prefix)) as writer:
            for document in tokens:
                writer.add_document(document)
    pieces = ["<unk>", "<s>", "</s>"] + [f"p{i}" for i in range(VOCAB - 3)]
    (root / "tokenizer.model").write_bytes(b"".join(
        _field(1, _field(1, piece.encode()) + b"\x15\x00\x00\x00\x00") for piece in pieces))
    vocab = {piece: i for i, piece in enumerate(pieces[:-1] + ["<|endoftext|>"])}
    (root / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}))
    (pile / "bpe").mkdir(parents=True, exist_ok=True)
    from epoverlap.data.tokenizers import _byte_chars
    gpt2 = {char: i for i, char in enumerate(_byte_chars()[b] for b in range(256))}
    (pile / "bpe" / "vocab.json").write_text(json.dumps({**gpt2, "<|endoftext|>": 256}))
    (pile / "bpe" / "merges.txt").write_text("#version: 0.2\n")


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    size, header = len(payload), bytearray()
    while True:
        header.append((size & 0x7F) | (0x80 if size > 0x7F else 0))
        size >>= 7
        if not size:
            break
    return bytes([number << 3 | 2]) + bytes(header) + payload


def refusal_lines(argv: list[str], world: int = RANKS, open_data: bool = False) -> list[str]:
    """Every line `epoverlap-train` would refuse `argv` with on `world` CPU ranks, in one run
    (argparse's usage line left out); [] if it would train. With `open_data`, the data files
    are opened too (as a rank does before any process group)."""
    import contextlib
    import io
    from epoverlap.cli.train import checked_config
    from epoverlap.errors import ConfigError
    from epoverlap.training.setup.data import open_data_source
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg, _, _ = checked_config(argv, world, cuda_available=False)
        if open_data:
            open_data_source(cfg, cfg.data_parallel_size(world))
    except ConfigError as error:
        return str(error).splitlines()
    except SystemExit:
        return [line.split(": error: ", 1)[1] for line in err.getvalue().splitlines()
                if ": error: " in line]
    return []


def dispositions(argv: list[str], world: int = RANKS, open_data: bool = False
                 ) -> dict[str, list[str]]:
    """Each flag of `argv` by what epoverlap does with it: 'refused' (named in the first run's
    lines), 'refused later' (named once those flags are dropped), 'unrecognized', 'accepted'
    (in the accepted-flags line once the refused ones are dropped) and 'implemented'."""
    from epoverlap.cli.train import checked_config
    from epoverlap.config.parse import accepted_notes
    groups = flag_values(argv)
    out: dict[str, list[str]] = {"refused": [], "refused later": [], "unrecognized": [],
                                 "accepted": [], "implemented": []}
    for attempt in range(4):
        lines = refusal_lines([t for g in groups for t in g], world, open_data)
        if not lines:
            break
        named = set()
        for line in lines:
            if line.startswith("unrecognized arguments: "):
                found = [t for t in line.split(": ", 1)[1].split() if t.startswith("--")]
                out["unrecognized"] += found
                named.update(found)
            else:
                flag = line.split("=", 1)[0].split(":", 1)[0]
                out["refused" if attempt == 0 else "refused later"].append(flag)
                named.add(flag)
        groups = [g for g in groups if g[0] not in named]
    cfg, _, _ = checked_config([t for g in groups for t in g], world, cuda_available=False)
    notes = {note.split(" ")[0] for note in accepted_notes(cfg)}
    for group in groups:
        out["accepted" if group[0] in notes else "implemented"].append(group[0])
    return out
