"""Generate from a checkpoint with TempNet's personal temperatures (or a fixed one).

    torchrun --nproc-per-node 2 tools/generate.py --load checkpoints/run \
        --tensor-model-parallel-size 2 --prompts prompts.txt --output gen.jsonl \
        --max-new-tokens 64 --sample --top-p 0.9 --seed 1 [--tau-max-eval 1.0]

Prompts: a text file with one prompt per line, a ``.jsonl`` file of ``{"prompt": ...}`` objects,
or ``-`` for standard input (text lines). Output: one JSON object per prompt (``--output``, or
standard output): ``index``, ``prompt``, ``response``, ``token_ids``, ``tokens`` (the text each
token adds), ``tau`` (the temperature each token was chosen with), ``tau_source``,
``stopped_at_eod``. Greedy by default; ``--sample`` samples from ``softmax(logits / tau)`` with
optional ``--top-k``/``--top-p``. The choice is vocabulary-parallel and does not depend on the
TP size: TP = 1 and TP = 2 give the same tokens for the same seed. Prompts are generated
``--micro-batch-size`` at a time with a KV cache (``--no-kv-cache``: recompute every step); a
prompt's tokens do not depend on the batch (sampling: each prompt has its own noise stream, from
the seed and its index). ``--tau-target-mean 0.7`` (the paper's Table 1 recipe) sets TempNet's
upper bound at inference so that its mean tau over the prompts' tokens (or over
``--tau-target-sample``) is 0.7; the records' ``sampling.tau_max_eval`` is the bound chosen.
The tokenizer is the one saved with the checkpoint unless tokenizer flags are given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch.distributed as dist

from megatron_tempnet.inference.cli import (
    add_model_args,
    apply_tau_target,
    load_from_args,
    read_texts,
)
from megatron_tempnet.inference.generation import GenerationError, generate, token_texts
from megatron_tempnet.inference.token_sampling import SamplingConfig
from megatron_tempnet.losses.tau_source import FixedTau
from megatron_tempnet.utils.cli import run_tool
from megatron_tempnet.utils.files import write_atomic
from megatron_tempnet.utils.progress import progress


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("generation")
    g.add_argument("--prompts", default="-", help="prompts file (.txt lines or .jsonl), - = stdin")
    g.add_argument("--output", help="JSONL output file (default: standard output)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234, help="sampling seed")
    g.add_argument("--ignore-eod", action="store_true", help="do not stop at end-of-document")
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=8,
        help="prompts generated together (default: %(default)s)",
    )
    g.add_argument(
        "--no-kv-cache",
        dest="kv_cache",
        action="store_false",
        help="recompute the whole sequences at every step instead of caching keys and values",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def read_prompts(path: str) -> list[str]:
    """Prompts from a text file (one per line), a .jsonl file, or standard input (``-``)."""
    return read_texts(path, "--prompts", ("prompt",), "prompts")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.max_new_tokens < 1:
        raise GenerationError(f"--max-new-tokens ({args.max_new_tokens}) must be >= 1")
    if args.micro_batch_size < 1:
        raise GenerationError(f"--micro-batch-size ({args.micro_batch_size}) must be >= 1")
    if args.output and os.path.isdir(args.output):
        raise GenerationError(f"--output {args.output} is a directory")
    prompts = read_prompts(args.prompts) if args.prompts != "-" else None
    model, tokenizer = load_from_args(args)
    if prompts is None:  # standard input reaches rank 0 only
        shared = [read_prompts("-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        prompts = shared[0]
    ids = [tokenizer.tokenize(p) for p in prompts]
    for i, tokens in enumerate(ids):
        if not tokens:
            raise GenerationError(f"--prompts {args.prompts}: prompt {i + 1} has no tokens")
    apply_tau_target(args, model, tokenizer, ids)
    sampling = SamplingConfig(
        greedy=not args.sample, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    budget = len(ids) * args.max_new_tokens
    with progress("generating", budget, unit="tok", enabled=dist.get_rank() == 0) as bar:
        outputs = generate(
            model,
            ids,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            tau=None if args.fixed_tau is None else FixedTau(args.fixed_tau),
            eod=None if args.ignore_eod else tokenizer.eod,
            micro_batch_size=args.micro_batch_size,
            kv_cache=args.kv_cache,
            on_tokens=bar.update,
        )
    if dist.get_rank() == 0:
        records = [
            _record(i, p, t, out, tokenizer, args)
            for i, (p, t, out) in enumerate(zip(prompts, ids, outputs))
        ]
        _write(records, args.output)
    dist.barrier()
    return 0


def _record(index: int, prompt: str, prompt_ids: list[int], out, tokenizer, args) -> dict:
    return {
        "index": index,
        "prompt": prompt,
        "response": tokenizer.detokenize(out.token_ids),
        "token_ids": out.token_ids,
        "tokens": token_texts(tokenizer.detokenize, out.token_ids, prompt_ids),
        "tau": out.tau,
        "tau_source": "fixed" if args.fixed_tau is not None else "tempnet",
        "stopped_at_eod": out.stopped_at_eod,
        "sampling": {
            "greedy": not args.sample,
            "top_k": args.top_k,
            "top_p": args.top_p,
            "seed": args.seed,
            "tau_max_eval": args.tau_max_eval,
        },
    }


def _write(records: list[dict], path: str | None) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if path is None:
        sys.stdout.write(text)
        return
    write_atomic(path, text)


if __name__ == "__main__":
    sys.exit(run_tool(main))
