"""pretrain_clip.py's flags (Megatron-LM/OpenCLIP names) and their ``CLIPRunConfig``."""

from __future__ import annotations

import argparse

from megatron_tempnet.data.arguments import add_tokenizer_args
from megatron_tempnet.data.image_text import ImageTextDataConfig
from megatron_tempnet.data.tokenizers import tokenizer_spec
from megatron_tempnet.models.clip import CLIP_PRESETS, CLIPModelConfig
from megatron_tempnet.training.arguments import add_common_args, common_configs
from megatron_tempnet.training.clip_module import CLIP_LOSSES, CLIPLossConfig
from megatron_tempnet.training.clip_task import CLIPEvalConfig, CLIPRunConfig

_MODEL_FLAGS = ("embed_dim", "image_size", "patch_size", "image_channels", "vision_layers",
                "vision_hidden_size", "vision_heads", "text_layers", "text_hidden_size",
                "text_heads", "context_length", "init_method_std",
                "make_vocab_size_divisible_by")  # fmt: skip


def build_clip_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train a CLIP model with TempNet or a baseline loss.")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="clip-tiny", choices=sorted(CLIP_PRESETS))
    for name in _MODEL_FLAGS:
        kind = float if name == "init_method_std" else int
        g.add_argument("--" + name.replace("_", "-"), type=kind, help="overrides the preset")
    g = p.add_argument_group("data")
    g.add_argument(
        "--train-data",
        nargs="+",
        required=True,
        metavar="PATH",
        help="manifests (.csv/.tsv/.jsonl: image path, caption) or .tar shards",
    )
    g.add_argument("--valid-data", nargs="+", metavar="PATH", help="held-out pairs (zero-shot)")
    g.add_argument(
        "--ood-data",
        nargs="+",
        metavar="PATH",
        help="out-of-distribution pairs: OOD AUROC of the temperature",
    )
    g.add_argument("--image-key", default="image")
    g.add_argument("--caption-key", default="caption")
    g.add_argument("--label-key", help="class name / image id column (retrieval, zero-shot)")
    g.add_argument("--image-mean", type=float, nargs="+")
    g.add_argument("--image-std", type=float, nargs="+")
    g.add_argument("--image-augment", action="store_true", help="random resized crops")
    g.add_argument(
        "--caption-noise",
        type=float,
        default=0.0,
        metavar="P",
        help="delete a word or substitute 'random' in P%% of training captions",
    )
    g.add_argument(
        "--skip-bad-samples",
        action="store_true",
        help="count and report bad rows/images instead of stopping",
    )
    g.add_argument(
        "--zeroshot-templates",
        nargs="+",
        metavar="TEMPLATE",
        help="prompts with {} for the class name, e.g. 'a photo of a {}.'",
    )
    g.add_argument("--eval-batch-size", type=int, default=64)
    g.add_argument("--seed", type=int, default=1234)
    add_tokenizer_args(p)
    g = p.add_argument_group("loss and TempNet")
    g.add_argument(
        "--clip-loss",
        choices=CLIP_LOSSES,
        default="tempnet",
        help="clip: InfoNCE, one learnable tau; sogclr: global contrastive loss, "
        "fixed tau; isogclr: a learned tau per sample; tempnet: TempNet's tau per "
        "image and text; tau: TaU (tau from a head on the embedding)",
    )
    g.add_argument(
        "--tau-init",
        type=float,
        default=0.01,
        help="clip's initial tau, sogclr's fixed tau, isogclr's initial per-sample "
        "tau, TaU's smallest tau",
    )
    g.add_argument("--tempnet-tau-min", type=float, default=0.001, help="tau0 (TempNet, isogclr)")
    g.add_argument("--tempnet-tau-max", type=float, default=0.05, help="TempNet's/isogclr's max")
    g.add_argument(
        "--tempnet-rho",
        type=float,
        default=8.0,
        help="the KL-DRO radius; rho >= log(global batch - 1) drives every tau to tau0",
    )
    g.add_argument(
        "--sogclr-gamma",
        type=float,
        default=0.8,
        help="moving-average weight of the per-sample estimator s, in (0, 1]",
    )
    g.add_argument(
        "--isogclr-tau-lr",
        type=float,
        default=0.01,
        help="step of isogclr's projected gradient update of each sample's tau",
    )
    g.add_argument("--tempnet-proj-size", type=int, default=256, help="d2: prototypes")
    g.add_argument("--tempnet-lr", type=float, help="TempNet's peak learning rate (default --lr)")
    g.add_argument("--tempnet-weight-decay", type=float)
    # the paper's Table 6: lr 2e-4, weight decay 0.02, Adam betas (0.9, 0.999)
    add_common_args(p, lr=2e-4, weight_decay=0.02, adam_beta2=0.999)
    return p


def clip_config_from_args(args: argparse.Namespace) -> CLIPRunConfig:
    model = CLIPModelConfig.from_preset(args.model, **{k: getattr(args, k) for k in _MODEL_FLAGS})
    data = ImageTextDataConfig(
        paths=list(args.train_data), image_key=args.image_key, caption_key=args.caption_key,
        label_key=args.label_key, augment=args.image_augment, caption_noise=args.caption_noise,
        skip_bad_samples=args.skip_bad_samples, seed=args.seed,
    )  # fmt: skip
    if args.image_mean:
        data.image_mean = tuple(args.image_mean)
    if args.image_std:
        data.image_std = tuple(args.image_std)
    return CLIPRunConfig(
        model=model,
        loss=CLIPLossConfig(clip_loss=args.clip_loss, tau_init=args.tau_init,
                            tau_min=args.tempnet_tau_min, tau_max=args.tempnet_tau_max,
                            rho=args.tempnet_rho, gamma=args.sogclr_gamma,
                            isogclr_tau_lr=args.isogclr_tau_lr),
        data=data,
        tokenizer=tokenizer_spec(args),
        evaluation=CLIPEvalConfig(valid_data=args.valid_data, ood_data=args.ood_data,
                                  zeroshot_templates=args.zeroshot_templates,
                                  eval_batch_size=args.eval_batch_size),
        **common_configs(args),
    )  # fmt: skip
