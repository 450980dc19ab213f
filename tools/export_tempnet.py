"""Export TempNet alone from a checkpoint (any TP x PP) for use outside this project.

    python tools/export_tempnet.py --load checkpoints/run --output tempnet/

writes ``tempnet/tempnet.safetensors`` (the full network: ``weight1 [d1, V]``, ``bias1``,
``weight2 [d2, d1]``, ``pooling.w3``, ``pooling.bias``, ``pooling.log_phi``) and
``tempnet/tempnet_config.json`` (``vocab_size``, ``d1``, ``d2``, ``tau0``, ``tau_max``, the input
normalisation and the run's loss settings). TempNet's checkpoint state is TP-agnostic, so the
export of a TP = 4 run is the same network as the export of a TP = 1 run. Use it with
``megatron_tempnet.inference.hf.TempNetLogitsProcessor`` or ``tools/generate.py --tempnet``.
"""

from __future__ import annotations

import argparse
import sys

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
from megatron_tempnet.inference.checkpoint_io import CheckpointReader, export_reader_tempnet
from megatron_tempnet.utils.cli import run_tool


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (its 'latest')")
    p.add_argument("--output", required=True, help="directory to write TempNet to")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reader = CheckpointReader(args.load)
    if not reader.has_tempnet():
        raise CheckpointError(
            f"--load {args.load}: {reader.path} holds no TempNet (a run with --tau-source "
            "tempnet saves one)"
        )
    config = export_reader_tempnet(reader, args.output)
    print(
        f"wrote {args.output}: TempNet d1={config['d1']} d2={config['d2']} over "
        f"{config['vocab_size']} tokens, tau in [{config['tau0']}, {config['tau_max']}]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
