"""docs/megatron_flags.md, "From Megatron-LM", generated from pretrain_gpt.py's own declarations.

    python -m megatron_tempnet.models.gpt.flag_table > docs/megatron_flags.md   (make docs)

A test checks the file against this output, so the table cannot drift from the code: the flags
with Megatron-LM's names, the other spellings (``GPTSpellings``, ``RunSpellings``) with what
each maps to, the refused flags with the reason, and the defaults that differ.
"""

from __future__ import annotations

import dataclasses

from megatron_tempnet.models.gpt.arguments import build_parser
from megatron_tempnet.models.gpt.megatron_flags import GPTSpellings
from megatron_tempnet.trainer import megatron_flags as run_flags
from megatron_tempnet.utils.flags import field_docs, flag_name

PROJECT_FLAGS = frozenset(
    {
        "--help", "--model", "--loss", "--tau-source", "--fixed-tau", "--no-fused-output-stage",
        "--output-stage-chunk-size", "--tempnet-hidden-size", "--tempnet-proj-size",
        "--tempnet-tau-min", "--tempnet-tau-max", "--no-tempnet-stop-grad", "--tempnet-lr",
        "--tempnet-weight-decay", "--tempnet-dropout", "--tempnet-constant-lr", "--zero-stage",
        "--freeze-lm", "--frozen-lm-cache", "--pretrained-checkpoint",
        "--keep-last", "--load-fallback", "--metrics-file", "--no-bias-swiglu-fusion",
        "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--tempnet-rho",
        "--deepspeed-config", "--rope-scaling-low-freq-factor", "--rope-scaling-high-freq-factor",
        "--rope-scaling-original-max-position-embeddings", "--checkpoint-timeout-minutes",
        "--ckpt-digest",
    }
)  # fmt: skip
"""pretrain_gpt.py's flags that Megatron-LM does not have (this project's own)."""

VALUE_LIMITS = [
    ("--context-parallel-size N", "1 only: context parallelism is not built"),
    ("--expert-model-parallel-size N", "1 only: mixture of experts is not built"),
    ("--transformer-impl transformer_engine", "local only: Transformer Engine is not used"),
    ("--rotary-percent P", "1.0 only: partial RoPE is not built"),
    ("--kv-channels K", "--hidden-size / --num-attention-heads only"),
]

CHECKPOINT_FORMAT = (
    "`--ckpt-format` names the format a run saves in. Megatron-LM's default, `torch_dist`, "
    "holds an LM's weights and Megatron-LM's optimizer state under megatron-core's names; this "
    "project's runs save `tempnet_dist` (the default here: TempNet, per-sample state, every "
    "rank's RNG and the data position have no place in Megatron-LM's). `torch_dist` and `torch` "
    "are accepted for Megatron-LM's scripts: the run saves `tempnet_dist` and its first lines "
    "say so. Megatron-LM's checkpoints of both formats load, whatever the flag says, with "
    "`--load`, `--finetune`, `--pretrained-checkpoint` and `--use-checkpoint-args` (and in "
    "every tool), at any TP x PP; `tools/checkpoint/export_megatron_lm.py` writes a run's LM "
    "as Megatron-LM's `torch_dist` (docs/interop.md)."
)
"""What --ckpt-format means here (it is left out of the flags with Megatron-LM's meaning)."""

DEFAULTS_THAT_DIFFER = [
    (
        "--loss, --tau-source",
        "dro, tempnet: the KL-DRO loss with TempNet (said at start-up)",
        "cross-entropy: `--loss ce`",
    ),
    ("--transformer-impl", "local (megatron-core's own layers)", "transformer_engine"),
    ("--ckpt-format", "tempnet_dist (this project's format, above)", "torch_dist"),
    (
        "--tokenizer-type",
        "GPT2BPETokenizer when --vocab-file and --merge-file are given (said at start-up)",
        "none (an error)",
    ),
]


def _spellings_rows(cls: type) -> list[str]:
    docs = field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        meaning, _, here = docs[f.name].partition(" Here: ")
        rows.append(f"| `{flag_name(f)}` | {meaning} | {here} |")
    return rows


def _same_name_flags() -> list[str]:
    spelled = {flag_name(f) for cls in (GPTSpellings, run_flags.RunSpellings)
               for f in dataclasses.fields(cls)}  # fmt: skip
    flags = {
        s
        for action in build_parser()._actions
        for s in action.option_strings
        if s.startswith("--") and "_" not in s
    }
    return sorted(flags - PROJECT_FLAGS - spelled - {"--ckpt-format"})


def markdown() -> str:
    lines = [
        "# From Megatron-LM: pretrain_gpt.py's flags",
        "",
        "Generated from the code by `python -m megatron_tempnet.models.gpt.flag_table` "
        "(`make docs`); a test keeps it current.",
        "",
        "## Same name, same meaning and default",
        "",
        "These flags of `pretrain_gpt.py` have Megatron-LM's names, meanings and defaults "
        "(`--help` shows each default):",
        "",
        ", ".join(f"`{flag}`" for flag in _same_name_flags()),
        "",
        "`--tokenizer-type`'s values too: `SentencePieceTokenizer` adds Megatron-LM's `<CLS>`, "
        "`<SEP>`, `<EOD>`, `<MASK>` (and pad, BOS, EOS pieces the model lacks) after the "
        "model's ids, its end of document `<EOD>`; `GPTSentencePieceTokenizer` is the model's "
        "own ids, its end of document the EOS piece; `Llama2Tokenizer` the same with a BOS "
        "before every text. Data preprocessed by Megatron-LM trains here with the same ids.",
        "",
        "## Checkpoints",
        "",
        CHECKPOINT_FORMAT,
        "",
        "## Other spellings",
        "",
        "Accepted for what this project computes anyway or under its own flag; the run's first "
        "lines say what each one given maps to.",
        "",
        "| flag | meaning (Megatron-LM, Megatron-DeepSpeed, TempNet) | here |",
        "| --- | --- | --- |",
        *_spellings_rows(GPTSpellings),
        *_spellings_rows(run_flags.RunSpellings),
        "",
        "## Not built: refused before anything starts",
        "",
        "A command line with any of these stops with one error naming all of them.",
        "",
        "| flag | why |",
        "| --- | --- |",
        *(f"| `{flag}` | {why} |" for flag, why in run_flags.REFUSED.items()),
        *(f"| `{prefix}...` | {why} |" for prefix, why in run_flags.REFUSED_PREFIXES.items()),
        *(f"| `{flag}` | {why} |" for flag, why in VALUE_LIMITS),
        "",
        "## Defaults that differ from Megatron-LM's",
        "",
        "| flag | here | Megatron-LM |",
        "| --- | --- | --- |",
        *(f"| `{flag}` | {here} | {theirs} |" for flag, here, theirs in DEFAULTS_THAT_DIFFER),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
