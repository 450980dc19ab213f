"""pretrain_gpt.py's flags (Megatron-LM names) and their translation into a ``RunConfig``."""

from __future__ import annotations

import argparse

from megatron_tempnet.data.arguments import add_data_args, add_tokenizer_args, data_config_from_args
from megatron_tempnet.data.tokenizers import tokenizer_spec
from megatron_tempnet.models.gpt import PRESETS, ModelConfig
from megatron_tempnet.training.config import (
    CheckpointConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
)
from megatron_tempnet.training.loss import LOSSES, TAU_SOURCES, LossConfig

_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "max_position_embeddings", "normalization",
                "position_embedding_type", "rotary_base", "norm_epsilon", "init_method_std",
                "hidden_dropout", "attention_dropout", "make_vocab_size_divisible_by")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Pretrain or finetune a GPT/LLaMA with TempNet.")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="architecture preset")
    for flag, kind in [("num-layers", int), ("hidden-size", int), ("num-attention-heads", int),
                       ("num-query-groups", int), ("ffn-hidden-size", int),
                       ("max-position-embeddings", int), ("rotary-base", int),
                       ("norm-epsilon", float), ("init-method-std", float),
                       ("hidden-dropout", float), ("attention-dropout", float),
                       ("make-vocab-size-divisible-by", int)]:  # fmt: skip
        g.add_argument(f"--{flag}", type=kind, help="overrides the preset")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"])
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument(
        "--openai-gelu",
        action="store_true",
        default=None,
        help="GELU's tanh approximation (GPT-2 as released, HF gelu_new)",
    )
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    g.add_argument("--disable-bias-linear", action="store_true", default=None)
    add_data_args(p, seq_length_default=None)  # None: the preset's
    add_tokenizer_args(p)
    g = p.add_argument_group("loss and TempNet")
    g.add_argument("--loss", choices=LOSSES, default="dro")
    g.add_argument("--tau-source", choices=TAU_SOURCES, default="tempnet")
    g.add_argument("--fixed-tau", type=float, default=1.0)
    g.add_argument("--tempnet-rho", type=float, default=10.0)
    g.add_argument("--tempnet-tau-min", type=float, default=0.001)
    g.add_argument("--tempnet-tau-max", type=float, default=2.0)
    g.add_argument("--tempnet-hidden-size", type=int, default=256)
    g.add_argument("--tempnet-proj-size", type=int, default=256)
    g.add_argument("--tempnet-lr", type=float)
    g.add_argument("--tempnet-weight-decay", type=float)
    g.add_argument("--no-tempnet-stop-grad", action="store_true")
    g.add_argument("--freeze-lm", action="store_true")
    add_common_args(p)
    return p


def add_common_args(p: argparse.ArgumentParser, *, lr: float = 6e-4,
                    weight_decay: float = 0.1, adam_beta2: float = 0.95) -> None:  # fmt: skip
    """Parallelism, optimizer, training, checkpoint and logging flags (every entry point)."""
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--zero-stage", type=int, default=0)
    g.add_argument("--deepspeed-config")
    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--lr", type=float, default=lr)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-fraction", type=float)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--weight-decay", type=float, default=weight_decay)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=adam_beta2)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--recompute-activations", action="store_true")
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--save")
    g.add_argument("--save-interval", type=int, default=0)
    g.add_argument("--load")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--exit-interval", type=int, default=0)
    g.add_argument(
        "--exit-duration-in-mins",
        type=float,
        default=0.0,
        help="after this many minutes: checkpoint and exit with status 75 (requeue)",
    )
    g.add_argument(
        "--pretrained-checkpoint",
        help="weights to start from while --load holds no checkpoint (then resumes)",
    )
    g.add_argument("--keep-last", type=int, default=0)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--tensorboard-dir")
    g.add_argument("--metrics-file")


def common_configs(args: argparse.Namespace, **training) -> dict:
    """The configs every run shares, from ``add_common_args``'s flags; ``training`` adds the
    entry point's own ``TrainingConfig`` fields."""
    warmup_fraction = args.lr_warmup_fraction
    if warmup_fraction is None and not args.lr_warmup_iters:
        warmup_fraction = 0.01  # the paper's Table 5
    return dict(
        parallel=ParallelConfig(args.tensor_model_parallel_size,
                                args.pipeline_model_parallel_size, args.zero_stage,
                                args.deepspeed_config),
        optimizer=OptimizerConfig(
            lr=args.lr, min_lr=args.min_lr, lr_warmup_fraction=warmup_fraction,
            lr_warmup_iters=args.lr_warmup_iters, lr_decay_iters=args.lr_decay_iters,
            weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
            tempnet_lr=args.tempnet_lr, tempnet_weight_decay=args.tempnet_weight_decay,
        ),
        training=TrainingConfig(
            train_iters=args.train_iters, micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size, eval_interval=args.eval_interval,
            eval_iters=args.eval_iters, seed=args.seed, bf16=args.bf16, fp16=args.fp16,
            recompute_activations=args.recompute_activations,
            tempnet_proj_size=args.tempnet_proj_size, **training,
        ),
        checkpoint=CheckpointConfig(
            save=args.save, save_interval=args.save_interval, load=args.load,
            finetune=args.finetune, no_load_optim=args.no_load_optim,
            exit_interval=args.exit_interval, keep_last=args.keep_last,
            exit_duration_in_mins=args.exit_duration_in_mins,
            pretrained_checkpoint=args.pretrained_checkpoint,
        ),
        logging=LoggingConfig(log_interval=args.log_interval,
                              tensorboard_dir=args.tensorboard_dir,
                              metrics_file=args.metrics_file),
    )  # fmt: skip


def config_from_args(args: argparse.Namespace) -> RunConfig:
    overrides = {k: getattr(args, k) for k in _MODEL_FLAGS}
    if args.seq_length is None:
        args.seq_length = PRESETS[args.model]["seq_length"]
    overrides.update(
        seq_length=args.seq_length,
        swiglu=args.swiglu,
        openai_gelu=args.openai_gelu,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        add_bias_linear=False if args.disable_bias_linear else None,
    )
    if args.max_position_embeddings is None and args.seq_length:
        overrides["max_position_embeddings"] = max(
            args.seq_length, PRESETS[args.model]["max_position_embeddings"]
        )
    return RunConfig(
        model=ModelConfig.from_preset(args.model, **overrides),
        loss=LossConfig(loss=args.loss, tau_source=args.tau_source, fixed_tau=args.fixed_tau,
                        rho=args.tempnet_rho, tau_min=args.tempnet_tau_min,
                        tau_max=args.tempnet_tau_max, stop_grad=not args.no_tempnet_stop_grad),
        data=data_config_from_args(args),
        tokenizer=tokenizer_spec(args),
        **common_configs(args, freeze_lm=args.freeze_lm,
                         tempnet_hidden_size=args.tempnet_hidden_size),
    )  # fmt: skip


def model_flags(model: ModelConfig) -> list[str]:
    """``pretrain_gpt.py`` flags that build exactly ``model`` (vocabulary from the tokenizer)."""
    flags = [
        "--num-layers", model.num_layers, "--hidden-size", model.hidden_size,
        "--num-attention-heads", model.num_attention_heads,
        "--ffn-hidden-size", model.ffn_hidden_size or 4 * model.hidden_size,
        "--max-position-embeddings", model.max_position_embeddings,
        "--normalization", model.normalization, "--norm-epsilon", model.norm_epsilon,
        "--position-embedding-type", model.position_embedding_type,
    ]  # fmt: skip
    if model.num_query_groups and model.num_query_groups != model.num_attention_heads:
        flags += ["--num-query-groups", model.num_query_groups]
    if model.position_embedding_type == "rope":
        flags += ["--rotary-base", model.rotary_base]
    for flag, on in (("--swiglu", model.swiglu), ("--openai-gelu", model.openai_gelu),
                     ("--untie-embeddings-and-output-weights",
                      model.untie_embeddings_and_output_weights),
                     ("--disable-bias-linear", not model.add_bias_linear)):  # fmt: skip
        if on:
            flags.append(flag)
    return [str(f) for f in flags]
