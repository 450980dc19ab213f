"""Concatenate indexed datasets (e.g. --partition-index outputs) into one, in the order given.

    python tools/merge_datasets.py --input owt2_part0_text_document owt2_part1_text_document \
        --output-prefix owt2_text_document
"""

from __future__ import annotations

import argparse
import sys

from megatron_tempnet.data.indexed import merge_datasets
from megatron_tempnet.data.preprocess import PreprocessError, check_output_free
from megatron_tempnet.utils.cli import run_tool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.output_prefix
    check_output_free(out, args.overwrite)
    if out in args.input:
        raise PreprocessError(f"--output-prefix {out!r} is also an --input")
    s = merge_datasets(args.input, out)
    print(f"wrote {out}.bin/.idx: {s.num_documents} documents, {s.num_tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
