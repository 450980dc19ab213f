"""Pretrain, finetune or TempNet-train a GPT-2/LLaMA model (Megatron-LM flags).

    torchrun --nproc-per-node 8 pretrain_gpt.py --model gpt2-125m \
        --data-path data/owt2_text_document --split 949,50,1 \
        --tokenizer-type GPT2BPETokenizer \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
        --tensor-model-parallel-size 2 --zero-stage 1 --micro-batch-size 4 \
        --global-batch-size 32 --train-iters 320000 --lr 6e-4 \
        --loss dro --tau-source tempnet --tempnet-rho 10 --save ckpt --save-interval 1000

Run `python pretrain_gpt.py --help` for every flag.
"""

from __future__ import annotations

import sys
import warnings

# NVIDIA apex and Transformer Engine are optional GPU accelerators: their absence is expected.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed")

from megatron_tempnet.models.gpt.arguments import build_parser, config_from_args  # noqa: E402
from megatron_tempnet.models.gpt.task import GPTTask  # noqa: E402
from megatron_tempnet.trainer.loop import pretrain  # noqa: E402
from megatron_tempnet.utils.cli import run_tool  # noqa: E402
from megatron_tempnet.utils.yaml_cfg import parse_with_yaml  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(parse_with_yaml(build_parser(), argv))
    return pretrain(config, GPTTask()).exit_code


if __name__ == "__main__":
    sys.exit(run_tool(main))
