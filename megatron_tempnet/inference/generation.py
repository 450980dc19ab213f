"""Generation with a personal temperature for every token (the paper's Table 1 / Figure 2 use).

At every step the model's last-position logits ``L`` (``[b, V_pad/tp]``, never gathered) give
tau: TempNet's prediction from ``L`` (``tau_max_eval`` may replace its upper bound, Figure 9) or
a fixed value; the next token is chosen from ``softmax(L / tau)`` (``TokenChooser``). Each prompt
is generated on its own (no padding), recomputing the whole sequence every step (no KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tempnet.distributed.groups import resolve_tp_group
from megatron_tempnet.inference.model import InferenceError, InferenceModel
from megatron_tempnet.inference.sampling import SamplingConfig, TokenChooser


@dataclass
class Generated:
    token_ids: list[int]
    """The generated tokens (without the prompt)."""
    tau: list[float]
    """The temperature each of them was chosen with."""
    stopped_at_eod: bool


class GenerationError(InferenceError):
    """A prompt that cannot be generated from; names it."""


def generate(
    model: InferenceModel,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    fixed_tau: float | None = None,
    eod: int | None = None,
) -> list[Generated]:
    """Continue every prompt (token ids) by up to ``max_new_tokens`` tokens.

    tau comes from ``model.tempnet`` unless ``fixed_tau`` is given. Generation stops early at
    ``eod`` (which is kept in the output).
    """
    if fixed_tau is None and model.tempnet is None:
        raise GenerationError("the checkpoint has no TempNet: give a fixed tau or --tempnet")
    tp = resolve_tp_group(model.tp_group)
    padded = model.model.padded_vocab_size(tp.size)
    chooser = TokenChooser(sampling, model.vocab_size, tp, padded // tp.size)
    limit = model.model.max_position_embeddings
    device = next(model.lm.parameters()).device
    results = []
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise GenerationError(f"prompt {i}: no tokens")
        if len(prompt) + max_new_tokens > limit:
            raise GenerationError(
                f"prompt {i}: {len(prompt)} tokens + --max-new-tokens {max_new_tokens} exceed the "
                f"model's {limit} positions"
            )
        tokens = torch.tensor([prompt], dtype=torch.long, device=device)
        out = Generated([], [], False)
        for _ in range(max_new_tokens):
            logits = model.logits(tokens)[:, -1]  # [1, V_pad/tp]
            tau = _tau(model, logits, fixed_tau)  # [1]
            token = chooser.choose(logits, tau)  # [1], the same on every rank
            out.token_ids.append(int(token[0]))
            out.tau.append(float(tau[0]))
            tokens = torch.cat([tokens, token[:, None].to(device)], dim=1)
            if eod is not None and out.token_ids[-1] == eod:
                out.stopped_at_eod = True
                break
        results.append(out)
    return results


@torch.no_grad()
def _tau(model: InferenceModel, logits: torch.Tensor, fixed_tau: float | None) -> torch.Tensor:
    if fixed_tau is not None:
        return torch.full(logits.shape[:1], float(fixed_tau), device=logits.device)
    return model.tempnet(logits)


def token_texts(detokenize, token_ids: list[int], prompt: list[int] | None = None) -> list[str]:
    """The text each generated token adds (decoding the growing sequence, so that pieces that
    depend on their neighbours, such as SentencePiece's leading spaces, come out right)."""
    context = list(prompt or [])
    texts, before = [], detokenize(context) if context else ""
    for token in token_ids:
        context.append(token)
        now = detokenize(context)
        texts.append(now[len(before) :] if now.startswith(before) else detokenize([token]))
        before = now
    return texts
