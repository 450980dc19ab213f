"""An lm-evaluation-harness model, ``megatron_tempnet``: log-likelihoods from ``softmax(L / tau)``.

    python -m megatron_tempnet.inference.lm_eval_adapter run --model megatron_tempnet \
        --model_args load=checkpoints/run,tau_max_eval=1.0 --tasks hellaswag

takes ``lm_eval``'s own arguments (the module registers the model, then runs lm-eval's CLI;
plain ``lm_eval`` does not know models of other packages). From Python, import this module and
call ``lm_eval.simple_evaluate(model="megatron_tempnet", model_args=...)``.

Model arguments: ``load`` (checkpoint, any saved layout), ``tempnet`` (an exported TempNet),
``fixed_tau`` (instead of TempNet), ``tau_max_eval``, ``pretrained_checkpoint``, the tokenizer
flags ``tokenizer_type``, ``tokenizer_model``, ``vocab_file``, ``merge_file`` (default: the
checkpoint's), ``max_length`` (default: the model's positions), ``bf16``, ``attention_backend``.
One process (TP = 1).
Every continuation token is scored with ``log softmax(L / tau)``, tau predicted by TempNet from
the same position's logits (the paper's T-LLM); ``is_greedy`` compares with ``argmax L``.
"""

from __future__ import annotations

import argparse

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from megatron_tempnet.inference.cli import load_from_args
from megatron_tempnet.inference.evaluation import score_tokens
from megatron_tempnet.inference.generation import generate
from megatron_tempnet.inference.sampling import SamplingConfig


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
        **_ignored,
    ):
        super().__init__()
        args = argparse.Namespace(
            load=str(load),
            pretrained_checkpoint=pretrained_checkpoint,
            tempnet=tempnet,
            fixed_tau=None if fixed_tau is None else float(fixed_tau),
            tau_max_eval=None if tau_max_eval is None else float(tau_max_eval),
            tensor_model_parallel_size=1,
            bf16=bool(bf16),
            attention_backend=attention_backend,
            tokenizer_type=tokenizer_type,
            tokenizer_model=tokenizer_model,
            vocab_file=vocab_file,
            merge_file=merge_file,
        )
        self.model, self.tokenizer = load_from_args(args)
        self.fixed_tau = args.fixed_tau
        self.max_length = int(max_length or self.model.model.max_position_embeddings)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        return self.tokenizer.tokenize(string)

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return self.tokenizer.detokenize(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        results = []
        for _, context, continuation in requests:
            whole = (context + continuation)[-(self.max_length + 1) :]
            scores = score_tokens(
                self.model, whole, window=len(whole) - 1, fixed_tau=self.fixed_tau
            )
            n = len(continuation)
            logprob = -sum(scores.tllm_ce[-n:])
            results.append((logprob, all(scores.greedy[-n:])))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        results = []
        for request in requests:
            tokens = [self.prefix_token_id, *self.tok_encode(request.args[0])]
            scores = score_tokens(
                self.model, tokens, window=self.max_length, fixed_tau=self.fixed_tau
            )
            results.append(-sum(scores.tllm_ce))
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation, cut at the first of the request's ``until`` strings."""
        outputs = []
        for request in requests:
            context, options = request.args
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else until
            room = self.max_length - 1
            prompt = self.tok_encode(context)[-room:]
            new = min(int(options.get("max_gen_toks", 256)), self.max_length - len(prompt))
            out = generate(
                self.model,
                [prompt],
                max_new_tokens=max(new, 1),
                sampling=SamplingConfig(greedy=True),
                fixed_tau=self.fixed_tau,
                eod=self.eot_token_id,
            )[0]
            text = self.tok_decode(out.token_ids)
            for stop in until:
                text = text.split(stop, 1)[0]
            outputs.append(text)
        return outputs


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
