"""Train a CLIP model (ViT + text transformer) with TempNet or a baseline contrastive loss.

    torchrun --nproc-per-node 8 pretrain_clip.py --model vit-b-16 \
        --train-data cc3m_train.csv --valid-data coco_karpathy_test.csv --label-key image_id \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model clip-tokenizer/ \
        --micro-batch-size 64 --train-iters 100000 --lr-warmup-iters 1000 \
        --clip-loss tempnet --tempnet-rho 8 --tempnet-lr 1e-4 --save ckpt --save-interval 1000

Losses: --clip-loss clip | sogclr | isogclr | tempnet | tau. Run `python pretrain_clip.py
--help` for every flag.
"""

from __future__ import annotations

import sys
import warnings

# NVIDIA apex and Transformer Engine are optional GPU accelerators: their absence is expected.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed")

from megatron_tempnet.models.clip.arguments import (  # noqa: E402
    build_clip_parser,
    clip_config_from_args,
)
from megatron_tempnet.models.clip.task import CLIPTask  # noqa: E402
from megatron_tempnet.trainer.loop import pretrain  # noqa: E402
from megatron_tempnet.utils.cli import run_tool  # noqa: E402
from megatron_tempnet.utils.flag_parser import FlagParser  # noqa: E402
from megatron_tempnet.utils.yaml_cfg import parse_with_yaml  # noqa: E402


def build_parser() -> FlagParser:
    """The command line of this program (also read by tools/cli_reference.py)."""
    return build_clip_parser()


def main(argv: list[str] | None = None) -> int:
    config = clip_config_from_args(parse_with_yaml(build_parser(), argv))
    return pretrain(config, CLIPTask()).exit_code


if __name__ == "__main__":
    sys.exit(run_tool(main))
