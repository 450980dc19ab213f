"""CPU quickstart: a tiny megatron-core GPT trained jointly with TempNet under the KL-DRO loss.

    torchrun --nproc-per-node 2 examples/quickstart.py     # tensor parallel over 2 gloo ranks
    python examples/quickstart.py                          # one process

Text: Python's own documentation topics (``pydoc_data``), as bytes (vocabulary 256). Every TP
rank holds half of the output layer's vocabulary and half of TempNet's first layer; the loss and
TempNet never gather the full logits. Prints the DRO loss, cross-entropy and tau statistics.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import warnings
from pydoc_data.topics import topics

# NVIDIA apex and Transformer Engine are optional GPU accelerators: their absence is expected.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed")
warnings.filterwarnings("ignore", message="When using async grad allreduce")  # CUDA-only advice

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tempnet.distributed import apply_cpu_support
from megatron_tempnet.losses import temperature_scaled_cross_entropy, vocab_parallel_dro_loss
from megatron_tempnet.tempnet import TempNetLM
from megatron_tempnet.utils.logging import get_logger, log_rank0

VOCAB = 256  # bytes
logger = get_logger("quickstart")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="training iterations")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="LM learning rate (AdamW)")
    p.add_argument("--tempnet-lr", type=float, default=1e-3, help="TempNet learning rate")
    p.add_argument(
        "--rho",
        type=float,
        default=4.0,
        help="DRO constant; keep it below log|C| = 5.55 for bytes, or every tau is "
        "pushed to tau-min (the paper's 10 is for 32k-50k vocabularies)",
    )
    p.add_argument("--tau-min", type=float, default=0.001)
    p.add_argument("--tau-max", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--metrics-file", help="append one JSON line per logged step")
    args = p.parse_args(argv)
    if not 0 < args.tau_min < args.tau_max:
        p.error(f"--tau-min ({args.tau_min}) must be > 0 and < --tau-max ({args.tau_max})")
    if args.steps < 1 or args.seq_length < 2 or args.micro_batch_size < 1:
        p.error("--steps, --micro-batch-size must be >= 1 and --seq-length >= 2")
    return args


def init_distributed() -> int:
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    apply_cpu_support()
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return tp


def corpus() -> torch.Tensor:
    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def batches(data: torch.Tensor, args, seed: int):
    """Random windows; the same generator on every TP rank, so all ranks see the same batch."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(
            0, data.numel() - args.seq_length - 1, (args.micro_batch_size,), generator=gen
        )
        window = torch.stack([data[s : s + args.seq_length + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]  # tokens, labels: [b, s]


def build(args, tp: int):
    torch.manual_seed(args.seed)  # CPU master-weight init: identical at every TP size
    model_parallel_cuda_manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=4,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=args.seq_length,
    )
    tempnet = TempNetLM(
        VOCAB, hidden_size=64, proj_size=64, tau_min=args.tau_min, tau_max=args.tau_max
    )
    optimizer = torch.optim.AdamW(
        [
            {"params": model.parameters(), "lr": args.lr},
            {"params": tempnet.parameters(), "lr": args.tempnet_lr},
        ],
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
    )
    return model, tempnet, optimizer


def train_step(model, tempnet, optimizer, tokens, labels, args):
    b, s = tokens.shape
    position_ids = torch.arange(s)[None].expand(b, s)
    causal = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    logits = model(tokens, position_ids, causal)  # [b, s, V/tp]
    tau = tempnet(logits)  # [b, s], from detached logits
    with torch.no_grad():
        ce = temperature_scaled_cross_entropy(logits, labels, 1.0, vocab_size=VOCAB).mean()
    loss = vocab_parallel_dro_loss(logits, labels, tau, rho=args.rho, vocab_size=VOCAB).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    tau = tau.detach()
    return dict(
        dro_loss=loss.item(),
        ce_loss=ce.item(),
        tau_mean=float(tau.mean()),
        tau_min=float(tau.min()),
        tau_max=float(tau.max()),
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tp = init_distributed()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    model, tempnet, optimizer = build(args, tp)
    log_rank0(
        "quickstart: GPT %d layers x %d hidden, TP = %d, TempNet %d params/rank, rho = %g",
        args.num_layers,
        args.hidden_size,
        tp,
        sum(p.numel() for p in tempnet.parameters()),
        args.rho,
        logger=logger,
    )
    data = batches(corpus(), args, args.seed)
    for step in range(1, args.steps + 1):
        metrics = train_step(model, tempnet, optimizer, *next(data), args)
        if step % args.log_interval == 0 or step in (1, args.steps):
            log_rank0(
                "step %4d | dro %.4f | ce %.4f | tau mean %.3f [%.3f, %.3f]",
                step,
                metrics["dro_loss"],
                metrics["ce_loss"],
                metrics["tau_mean"],
                metrics["tau_min"],
                metrics["tau_max"],
                logger=logger,
            )
            if args.metrics_file and dist.get_rank() == 0:
                with open(args.metrics_file, "a") as f:
                    f.write(json.dumps({"step": step, **metrics}) + "\n")
    log_rank0("quickstart finished: %d steps", args.steps, logger=logger)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
