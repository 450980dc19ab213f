"""An lm-evaluation-harness model, ``megatron_tempnet``: log-likelihoods from ``softmax(L / tau)``.

    python -m megatron_tempnet.inference.lm_eval_adapter run --model megatron_tempnet \
        --model_args load=checkpoints/run,tau_max_eval=1.0 --tasks hellaswag --batch_size 16

    torchrun --nproc-per-node 8 -m megatron_tempnet.inference.lm_eval_adapter run \
        --model megatron_tempnet --model_args load=checkpoints/llama70b --tasks hellaswag

takes ``lm_eval``'s own arguments (the module registers the model, then runs lm-eval's CLI).
lm-eval 0.4 finds models only in its own package (no plugin entry points), so plain ``lm_eval
--model megatron_tempnet`` cannot know this one; from Python, import this module and call
``lm_eval.simple_evaluate(model="megatron_tempnet", model_args=...)``.

Tensor parallelism: launched with torchrun, the model is split over the processes (TP = their
number). Rank 0 runs lm-eval; the other ranks build their shard and follow rank 0's batches
(``inference.service``).

Model arguments: ``load`` (checkpoint, any saved layout), ``tempnet`` (an exported TempNet),
``fixed_tau`` (instead of TempNet), ``tau_max_eval``, ``pretrained_checkpoint``, the tokenizer
flags ``tokenizer_type``, ``tokenizer_model``, ``vocab_file``, ``merge_file`` (default: the
checkpoint's), ``max_length`` (default: the model's positions), ``bf16``, ``attention_backend``;
any other is refused by name (lm-eval's own ``max_batch_size`` and ``device`` are accepted and
not used).
lm-eval's ``--batch_size`` is the number of requests per forward pass (``auto``: 16); its
progress bars follow lm-eval's settings.

Every continuation token is scored with ``log softmax(L / tau)``, tau predicted by TempNet from
the same position's logits (the paper's T-LLM); ``is_greedy`` compares with ``argmax L``.
``generate_until`` is greedy, batched, with the KV cache, cut at the first ``until`` string.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from megatron_tempnet.inference.cli import load_from_args
from megatron_tempnet.inference.evaluation import merge, windows
from megatron_tempnet.inference.model import InferenceError, init_inference
from megatron_tempnet.inference.service import Service, share, world
from megatron_tempnet.inference.token_sampling import SamplingConfig
from megatron_tempnet.losses.tau_source import FixedTau
from megatron_tempnet.utils.cli import run_tool

AUTO_BATCH_SIZE = 16
_log = logging.getLogger(__name__)
LM_EVAL_ARGUMENTS = {"max_batch_size", "device"}
"""What lm-eval adds to every model's arguments: accepted, not used (the model runs on this
process's own device, ``batch_size`` requests at a time)."""


@dataclass
class _Rank0:
    """What rank 0's model tells ``main`` when lm-eval is done (lm-eval builds the model, so this
    cannot be passed to it): whether the other ranks received its arguments, and the service
    they follow."""

    shared: bool = False
    service: Service | None = None


_RANK0 = _Rank0()


@register_model("megatron_tempnet")
class MegatronTempNetLM(TemplateLM):
    backend = "causal"

    def __init__(
        self,
        load: str,
        tempnet: str | None = None,
        fixed_tau: float | None = None,
        tau_max_eval: float | None = None,
        pretrained_checkpoint: str | None = None,
        tokenizer_type: str | None = None,
        tokenizer_model: str | None = None,
        vocab_file: str | None = None,
        merge_file: str | None = None,
        max_length: int | None = None,
        bf16: bool = False,
        attention_backend: str = "auto",
        batch_size: int | str | None = None,
        **others,
    ):
        super().__init__()
        unknown = sorted(set(others) - LM_EVAL_ARGUMENTS)
        if unknown:
            raise InferenceError(
                f"--model_args: unknown argument(s) {', '.join(unknown)} for megatron_tempnet "
                "(its arguments: load, tempnet, fixed_tau, tau_max_eval, pretrained_checkpoint, "
                "tokenizer_type, tokenizer_model, vocab_file, merge_file, max_length, bf16, "
                "attention_backend)"
            )
        args = argparse.Namespace(
            load=str(load),
            pretrained_checkpoint=pretrained_checkpoint,
            tempnet=tempnet,
            fixed_tau=None if fixed_tau is None else float(fixed_tau),
            tau_max_eval=None if tau_max_eval is None else float(tau_max_eval),
            tau_target_mean=None,
            tau_target_sample=None,
            tensor_model_parallel_size=int(os.environ.get("WORLD_SIZE", "1")),
            bf16=str(bf16).lower() in ("1", "true"),
            attention_backend=attention_backend,
            tokenizer_type=tokenizer_type,
            tokenizer_model=tokenizer_model,
            vocab_file=vocab_file,
            merge_file=merge_file,
        )
        self.batch_size = _batch_size(batch_size)
        if world()[1] > 1:
            share(args)  # the followers build their shards with the same arguments
            _RANK0.shared = True
        self.model, self.tokenizer = load_from_args(args)
        self.service = _RANK0.service = Service(self.model)
        self.fixed_tau = args.fixed_tau
        self.max_length = int(max_length or self.model.model.max_position_embeddings)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        return self.tokenizer.tokenize(string)

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return self.tokenizer.detokenize(tokens)

    def _score(self, sequences: list[list[int]], first: list[int] | None, progress) -> list:
        """``score_sequences`` on every rank, ``batch_size`` sequences per call."""
        scores = []
        for begin in range(0, len(sequences), self.batch_size):
            part = slice(begin, begin + self.batch_size)
            scores += self.service.call(
                "score",
                sequences=sequences[part],
                first=None if first is None else first[part],
                tau=None if self.fixed_tau is None else FixedTau(self.fixed_tau),
                micro_batch_size=self.batch_size,
            )
            progress.update(len(sequences[part]))
        return scores

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        sequences, first = [], []
        for _, context, continuation in requests:
            if not continuation:
                raise InferenceError("lm-eval asked for the log-likelihood of an empty "
                                     "continuation")  # fmt: skip
            whole = (context + continuation)[-(self.max_length + 1) :]
            sequences.append(whole)
            first.append(max(1, len(whole) - len(continuation)))
        with tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood") as bar:
            scores = self._score(sequences, first, bar)
        return [(-sum(s.tllm_ce), all(s.greedy)) for s in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        cut = [
            windows([self.prefix_token_id, *self.tok_encode(r.args[0])], self.max_length)
            for r in requests
        ]
        flat = [w for parts in cut for w in parts]
        with tqdm(total=len(flat), disable=disable_tqdm, desc="rolling windows") as bar:
            scores = self._score(flat, None, bar)
        results, offset = [], 0
        for parts in cut:
            results.append(-sum(merge(scores[offset : offset + len(parts)]).tllm_ce))
            offset += len(parts)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (KV cache, ``batch_size`` prompts at a time), each cut at the
        first of its request's ``until`` strings."""
        prepared = []
        for request in requests:
            context, options = request.args
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            prompt = self.tok_encode(context)[-(self.max_length - 1) :]
            new = min(int(options.get("max_gen_toks", 256)), self.max_length - len(prompt))
            prepared.append((prompt, max(new, 1), until))
        outputs: list[str | None] = [None] * len(requests)
        groups: dict[int, list[int]] = {}
        for i, (_, new, _) in enumerate(prepared):
            groups.setdefault(new, []).append(i)
        with tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until") as bar:
            for new, members in groups.items():
                for begin in range(0, len(members), self.batch_size):
                    batch = members[begin : begin + self.batch_size]
                    generated = self.service.call(
                        "generate",
                        prompts=[prepared[i][0] for i in batch],
                        max_new_tokens=new,
                        sampling=SamplingConfig(greedy=True),
                        tau=None if self.fixed_tau is None else FixedTau(self.fixed_tau),
                        eod=self.eot_token_id,
                        micro_batch_size=self.batch_size,
                    )
                    for i, out in zip(batch, generated):
                        text = self.tok_decode(out.token_ids)
                        for stop in prepared[i][2]:
                            text = text.split(stop, 1)[0]
                        outputs[i] = text
                    bar.update(len(batch))
        return outputs


def _batch_size(value) -> int:
    if value is None or str(value).startswith("auto"):
        if value is not None:
            _log.info("batch_size %s: %d requests per forward pass", value, AUTO_BATCH_SIZE)
        return AUTO_BATCH_SIZE
    try:
        size = int(value)
    except ValueError:
        raise InferenceError(f"batch_size {value!r}: expected a number or auto") from None
    if size < 1:
        raise InferenceError(f"batch_size ({size}) must be >= 1")
    return size


def main() -> int:
    from lm_eval.__main__ import cli_evaluate

    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1:
        init_inference(size)
        if world()[0] != 0:
            args = share()  # None: rank 0 stopped before building the model
            if args is not None:
                model, _ = load_from_args(args)
                Service(model).follow()
            return 0
    try:
        cli_evaluate()
    finally:
        if size > 1 and not _RANK0.shared:
            share(None)
        elif _RANK0.service is not None:
            _RANK0.service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
