r"""Tokenize .jsonl / .jsonl.zst / .jsonl.gz corpora into megatron-core indexed datasets.

    python tools/preprocess_data.py --input openwebtext2.jsonl.zst.tar --output-prefix data/owt2 \
        --tokenizer-type GPT2BPETokenizer \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
        --append-eod --workers 16

writes data/owt2_text_document.bin/.idx (train with --data-path data/owt2_text_document).
Progress: a bar on a terminal, otherwise a line every $MEGATRON_TEMPNET_PROGRESS_INTERVAL
seconds (default 30).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from megatron_tempnet.data.preprocess import PreprocessConfig, run_preprocess
from megatron_tempnet.data.tokenizers import TokenizerConfig
from megatron_tempnet.utils.cli import run_tool
from megatron_tempnet.utils.flags import add_flags, from_flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_argument_group("input and output")
    g.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="input files (.jsonl, .jsonl.zst, .jsonl.gz), .tar/.tar.gz archives of them\n"
        "(read in place), directories (recursive) or quoted globs ('data/**/*.zst');\n"
        "a directory, glob or archive is read sorted by path, directory by directory",
    )
    g.add_argument(
        "--output-prefix",
        required=True,
        help="writes PREFIX_{key}_document.bin/.idx for every --json-keys key",
    )
    g.add_argument("--json-keys", nargs="+", default=["text"], help="string fields to tokenize")
    g.add_argument("--overwrite", action="store_true", help="replace existing output datasets")
    add_flags(p, TokenizerConfig, "tokenizer")
    g = p.add_argument_group("processing")
    g.add_argument(
        "--append-eod",
        action="store_true",
        help="end every document with the tokenizer's end-of-document token",
    )
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="split the input files into this many contiguous groups, each written as "
        "PREFIX_part{i}_{key}_document, then merged (see --keep-partitions)",
    )
    g.add_argument(
        "--keep-partitions",
        action="store_true",
        help="keep the partition datasets separate instead of merging them",
    )
    g.add_argument(
        "--partition-index",
        type=int,
        help="process only this partition (e.g. one per SLURM array task); merge "
        "later with tools/merge_datasets.py",
    )
    g.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip lines that are not a JSON object with string --json-keys, report "
        "each one and count them (default: stop at the first, naming file:line)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = PreprocessConfig(
        inputs=args.input,
        output_prefix=args.output_prefix,
        tokenizer=dataclasses.asdict(from_flags(TokenizerConfig, args)),
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        workers=args.workers,
        partitions=args.partitions,
        keep_partitions=args.keep_partitions,
        partition_index=args.partition_index,
        skip_bad_lines=args.skip_bad_lines,
        overwrite=args.overwrite,
    )
    run_preprocess(config)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
