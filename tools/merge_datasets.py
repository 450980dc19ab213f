"""Concatenate indexed datasets (e.g. --partition-index outputs) into one, in the order given.

    python tools/merge_datasets.py --input owt2_part0_text_document owt2_part1_text_document \
        --output-prefix owt2_text_document

The inputs' tokenizer records (PREFIX.tokenizer.json) must agree: the output carries theirs.
Inputs of two tokenizers are refused; when an input has none, the output has none either.
"""

from __future__ import annotations

import argparse
import sys

from megatron_tempnet.data.indexed import merge_datasets
from megatron_tempnet.data.preprocess import PreprocessError, check_output_free
from megatron_tempnet.data.tokenizer_sidecar import merged_sidecar, read_sidecar, write_sidecar
from megatron_tempnet.utils.cli import run_tool


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PREFIX",
        help="dataset prefixes (without .bin/.idx)",
    )
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin/.idx")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.output_prefix
    check_output_free(out, args.overwrite)
    if out in args.input:
        raise PreprocessError(f"--output-prefix {out!r} is also an --input")
    tokenizer = merged_sidecar(args.input)  # refuses inputs of two tokenizers, before writing
    s = merge_datasets(args.input, out)
    print(f"wrote {out}.bin/.idx: {s.num_documents} documents, {s.num_tokens} tokens")
    if tokenizer is not None:
        write_sidecar(out, *tokenizer)
        print(f"tokenizer: {tokenizer[0].describe()} (wrote {out}.tokenizer.json)")
    else:
        unknown = [p for p in args.input if read_sidecar(p) is None]
        print(f"tokenizer: unknown ({unknown[0]} has no .tokenizer.json); the output has none")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
