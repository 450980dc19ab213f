"""Cross-entropy perplexity and the paper's T-LLM perplexity of a checkpoint on held-out text.

    torchrun --nproc-per-node 2 tools/evaluate.py --load checkpoints/run \
        --tensor-model-parallel-size 2 --data-path data/owt2_valid_text_document \
        --seq-length 1024 --output eval.json

``--data-path`` reads an indexed dataset (``tools/preprocess_data.py``; refused when its recorded
tokenizer is not the model's or it holds an id outside the vocabulary), ``--jsonl`` a ``.jsonl``
file (``--json-key``, default ``text``) tokenised here. ``--documents concatenated`` (default)
joins the documents (with end-of-document tokens) into one stream cut into windows of
``--seq-length`` predictions; ``separate`` scores each document on its own. Printed and written
to ``--output``: ``ppl = exp(mean CE)``, ``tllm_ppl = exp(mean CE of softmax(logits / tau))`` with
tau from ``--tau-source``, and tau statistics. ``--tau-source`` is TempNet's prediction
(``tempnet``, the default), ``--fixed-tau`` (``fixed``), or ``newton``: each token's exact
minimiser of the DRO loss (eq. 2) over ``--tempnet-tau-min <= tau <= --tempnet-tau-max`` for
``--tempnet-rho`` (defaults: the run's own, else the paper's), by Newton's method over the
vocabulary-parallel logits, the temperature a TempNet trained with that loss approximates. With
a TempNet loaded, ``newton`` also reports TempNet's tau (``tempnet_tau_mean``, ``_std``) and its
correlation with the optimum (``tau_correlation``) and its T-LLM perplexity
(``tempnet_tllm_ppl``). ``--tau-grid`` adds the T-LLM perplexity at each of several fixed
temperatures and the best of them, from the same forward pass. Windows of every document are scored
``--micro-batch-size`` at a time (right-padded; the values do not depend on the batch).
``--calibration`` adds, per tau (1, the scored one, TempNet's beside ``newton``, the grid's
best), the expected calibration error of the top-1 prediction (15 equal-width bins of its
probability), the Brier score, the NLL and the reliability bins (a reliability diagram's points).
``--tau-target-mean M`` first sets TempNet's upper bound at inference so that its mean tau
over the scored tokens (or ``--tau-target-sample``) is ``M``, the paper's inference-time
scaling; ``tau_target`` in the output has the bound chosen (``tau_max_eval``: pass it to
``generate.py``, ``serve.py`` or ``TempNetLogitsProcessor``). ``--per-token-output`` writes
one JSON object per scored stream/document with its first token's text (``prompt``) and every
target's text (``tokens``), id (``targets``), ``ce``, ``tllm_logprob`` and ``tau`` (with
``newton`` and a TempNet, ``tempnet_tau`` too): ``tools/visualize_tau.py`` renders it.
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
)
from megatron_tempnet.inference.evaluation import merge, score_sequences, summarise, windows
from megatron_tempnet.inference.generation import long_token_texts
from megatron_tempnet.inference.model import InferenceError
from megatron_tempnet.losses.tau_source import FixedTau, NewtonTau
from megatron_tempnet.utils.cli import run_tool
from megatron_tempnet.utils.files import write_atomic
from megatron_tempnet.utils.progress import progress


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("data")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--data-path", help="indexed dataset prefix (without .bin/.idx)")
    src.add_argument("--jsonl", help="a .jsonl file of documents")
    g.add_argument("--json-key", default="text")
    g.add_argument("--seq-length", type=int, help="predictions per window (default: the model's)")
    g.add_argument("--documents", choices=["concatenated", "separate"], default="concatenated")
    g.add_argument("--max-documents", type=int, help="only the first N documents")
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=8,
        help="windows per forward pass (default: %(default)s)",
    )
    t = p.add_argument_group("temperature")
    t.add_argument(
        "--tau-source",
        choices=["tempnet", "fixed", "newton"],
        help="tau of the T-LLM scores: TempNet's, --fixed-tau, or each token's DRO optimum "
        "(default: fixed with --fixed-tau, else tempnet)",
    )
    for flags, dest, what in (
        (("--tempnet-rho", "--rho"), "rho", "rho of eq. 2 (default: the run's, else 10)"),
        (
            ("--tempnet-tau-min", "--tau-min"),
            "tau_min",
            "lower bound (default: the run's, else 0.001)",
        ),
        (
            ("--tempnet-tau-max", "--tau-max"),
            "tau_max",
            "upper bound (default: the run's, else 2.0)",
        ),
    ):
        t.add_argument(*flags, dest=dest, type=float, help=f"newton: {what}")
    t.add_argument(
        "--tau-grid",
        type=float,
        nargs="+",
        default=[],
        metavar="TAU",
        help="also the T-LLM perplexity at each of these fixed temperatures, from the same "
        "forward pass (tau_grid, best_fixed_tau, best_fixed_tllm_ppl)",
    )
    t.add_argument(
        "--calibration",
        action="store_true",
        help="also the calibration of the top-1 prediction at tau = 1, at the scored tau, at "
        "TempNet's beside --tau-source newton and at --tau-grid's best: expected calibration "
        "error (15 bins), Brier score, NLL and the reliability bins (calibration; from each "
        "window's whole logits, as --no-fused-output-stage)",
    )
    g.add_argument("--output", help="write the summary JSON here too")
    g.add_argument("--per-token-output", help="JSONL of per-token scores")
    g.add_argument(
        "--no-fused-output-stage",
        dest="fused_output_stage",
        action="store_false",
        help="form each window's whole [tokens, V/tp] logits instead of scoring from the final "
        "hidden states chunk by chunk",
    )
    g.add_argument(
        "--output-stage-chunk-size",
        type=int,
        default=0,
        help="tokens per chunk of the fused output stage (0: the default, 32M logits per rank)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def read_documents(args, tokenizer, vocab_size: int) -> list[list[int]]:
    limit = args.max_documents
    if args.data_path:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        from megatron_tempnet.data.gpt_data import check_datasets
        from megatron_tempnet.data.indexed import validate_indexed_dataset

        validate_indexed_dataset(args.data_path)
        # the dataset's recorded tokenizer must be the model's, its ids inside the vocabulary
        check_datasets([args.data_path], tokenizer.identity, vocab_size, cache_dir=None)
        dataset = IndexedDataset(args.data_path)
        count = len(dataset) if limit is None else min(limit, len(dataset))
        return [dataset[i].tolist() for i in range(count)]
    if not os.path.isfile(args.jsonl):
        raise InferenceError(f"--jsonl {args.jsonl}: no such file")
    documents = []
    with open(args.jsonl, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[args.json_key]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise InferenceError(
                    f"{args.jsonl}:{number}: not a JSON object with a string {args.json_key!r}"
                ) from None
            if not isinstance(text, str):
                raise InferenceError(f"{args.jsonl}:{number}: {args.json_key!r} is not a string")
            documents.append(tokenizer.tokenize(text))
            if limit is not None and len(documents) == limit:
                break
    return documents


def newton_settings(args, config: dict) -> NewtonTau:
    """``--tau-source newton``'s rho and bounds: the flags, else the run's loss settings, else
    the paper's (``LossConfig``'s defaults)."""
    from megatron_tempnet.models.gpt.objective import LossConfig
    from megatron_tempnet.tempnet.config import saved_loss_settings

    saved, paper = saved_loss_settings(config.get("loss") or {}), LossConfig()
    rho = args.rho if args.rho is not None else saved.get("rho", paper.rho)
    low = args.tau_min if args.tau_min is not None else saved.get("tau_min", paper.tempnet.tau_min)
    high = args.tau_max if args.tau_max is not None else saved.get("tau_max", paper.tempnet.tau_max)
    if not rho > 0:
        raise InferenceError(f"--tempnet-rho ({rho}) must be > 0 for --tau-source newton")
    if not 0 < low < high:
        raise InferenceError(
            f"--tempnet-tau-min ({low}) must be > 0 and < --tempnet-tau-max ({high})"
        )
    return NewtonTau(float(rho), float(low), float(high))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.output_stage_chunk_size < 0:
        raise InferenceError(
            f"--output-stage-chunk-size ({args.output_stage_chunk_size}) must be >= 1, or 0 for "
            "the default"
        )
    source = args.tau_source or ("fixed" if args.fixed_tau is not None else "tempnet")
    if source == "fixed" and args.fixed_tau is None:
        raise InferenceError("--tau-source fixed needs --fixed-tau")
    if source != "fixed" and args.fixed_tau is not None:
        raise InferenceError(f"--fixed-tau is for --tau-source fixed, not {source}")
    model, tokenizer = load_from_args(args, need_tempnet=source == "tempnet")
    tau = None  # TempNet's
    if source == "newton":
        tau = newton_settings(args, model.config)
    elif source == "fixed":
        tau = FixedTau(args.fixed_tau)
    grid = tuple(args.tau_grid)
    if any(not t > 0 for t in grid):
        raise InferenceError(
            f"--tau-grid {' '.join(f'{t:g}' for t in grid)}: every tau must be > 0"
        )
    window = args.seq_length or model.model.max_position_embeddings
    if not 0 < window <= model.model.max_position_embeddings:
        raise InferenceError(
            f"--seq-length ({window}) must be in [1, "
            f"{model.model.max_position_embeddings}] (the model's positions)"
        )
    documents = read_documents(args, tokenizer, min(tokenizer.vocab_size, model.vocab_size))
    if args.documents == "concatenated":
        eod = [] if tokenizer.eod is None else [tokenizer.eod]
        documents = [[t for d in documents for t in (d if args.data_path else d + eod)]]
    # every document's windows, scored --micro-batch-size at a time across documents
    cut = [windows(d, window) for d in documents]
    sequences = [w for parts in cut for w in parts]
    fitted = apply_tau_target(args, model, tokenizer, sequences, own_every_position=False)
    total = sum(len(w) - 1 for w in sequences)
    with progress("scoring", total, unit="tok", enabled=dist.get_rank() == 0) as bar:
        flat = score_sequences(
            model,
            sequences,
            tau=tau,
            grid=grid,
            fused_output_stage=args.fused_output_stage,
            chunk_size=args.output_stage_chunk_size or None,
            micro_batch_size=args.micro_batch_size,
            on_tokens=bar.update,
            calibration=args.calibration,
        )
    scores, offset = [], 0
    for parts in cut:
        scores.append(merge(flat[offset : offset + len(parts)]))
        offset += len(parts)
    summary = summarise(scores, grid)
    summary.update(
        documents=len(documents) if args.documents == "separate" else None,
        tau_source=source,
        tau_max_eval=args.tau_max_eval,
        **({"tau_target": fitted} if fitted else {}),
        **({"rho": tau.rho, "tau_min": tau.tau_min, "tau_max": tau.tau_max}
           if isinstance(tau, NewtonTau) else {}),
    )  # fmt: skip
    if dist.get_rank() == 0:
        _write_outputs(args, summary, scores, documents, tokenizer)
    dist.barrier()
    return 0


def _write_outputs(args, summary: dict, scores: list, documents: list, tokenizer) -> None:
    """The summary (printed, and --output), and --per-token-output's one line per document."""
    print(json.dumps(summary))
    if args.output:
        write_atomic(args.output, json.dumps(summary, indent=2) + "\n")
    if args.per_token_output:
        rows = [
            json.dumps(
                {
                    "index": i,
                    "prompt": tokenizer.detokenize(d[:1]),  # the first token: not scored
                    "tokens": long_token_texts(tokenizer.detokenize, s.targets, d[:1]),
                    "targets": s.targets,
                    "ce": s.ce,
                    "tllm_logprob": [-x for x in s.tllm_ce],
                    "tau": s.tau,
                    **({"tempnet_tau": s.tempnet_tau} if s.tempnet_tau else {}),
                }
            )
            for i, (s, d) in enumerate(zip(scores, documents))
        ]
        write_atomic(args.per_token_output, "".join(r + "\n" for r in rows))


if __name__ == "__main__":
    sys.exit(run_tool(main))
