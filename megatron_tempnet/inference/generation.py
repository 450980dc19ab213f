"""Generation with a personal temperature for every token (the paper's Table 1 / Figure 2 use).

At every step the model's logits ``L`` at each sequence's newest position (``[b, V_pad/tp]``,
never gathered) give tau: TempNet's prediction from ``L`` (``tau_max_eval`` may replace its upper
bound, Figure 9) or a fixed value; the next token is chosen from ``softmax(L / tau)``
(``TokenChooser``).

Prompts are generated in batches of ``micro_batch_size``, longest first. A batch is right-padded
and run once through the model (the prefill), filling a ``KVCache`` with every layer's keys and
values; then each step runs the one new token of every sequence, at that sequence's own
position, against the cache: the cost of a step does not grow with the length beyond the
attention over the cache. Causal attention makes the padding after a short prompt invisible to
it, and the cache slots the padding filled are overwritten by that sequence's own next tokens.
Each sequence stops at its end-of-document token or ``max_new_tokens``. ``kv_cache=False``
recomputes the whole sequences at every step instead (any attention backend; quadratic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_tempnet.distributed.groups import resolve_tp_group
from megatron_tempnet.inference.model import InferenceError, InferenceModel
from megatron_tempnet.inference.token_sampling import SamplingConfig, TokenChooser
from megatron_tempnet.losses.tau_source import FixedTau, TempNetTau


@dataclass
class Generated:
    token_ids: list[int]
    """The generated tokens (without the prompt)."""
    tau: list[float]
    """The temperature each of them was chosen with."""
    stopped_at_eod: bool


class GenerationError(InferenceError):
    """A prompt that cannot be generated from; names it."""


def check_prompts(
    model: InferenceModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    flag: str = "--max-new-tokens",
) -> None:
    """Raise ``GenerationError`` naming the first prompt that is empty or too long (``flag``
    names the number of new tokens)."""
    if max_new_tokens < 1:
        raise GenerationError(f"{flag} ({max_new_tokens}) must be >= 1")
    limit = model.model.max_position_embeddings
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise GenerationError(f"prompt {i}: no tokens")
        if len(prompt) + max_new_tokens > limit:
            raise GenerationError(
                f"prompt {i}: {len(prompt)} tokens + {flag} {max_new_tokens} exceed the "
                f"model's {limit} positions"
            )
        bad = [t for t in prompt if not 0 <= t < model.vocab_size]
        if bad:
            raise GenerationError(
                f"prompt {i}: token id {bad[0]} is outside the model's vocabulary of "
                f"{model.vocab_size}"
            )


def generate(
    model: InferenceModel,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    tau: FixedTau | TempNetTau | None = None,
    eod: int | None = None,
    micro_batch_size: int = 8,
    kv_cache: bool = True,
    on_step: Callable[[int], None] | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> list[Generated]:
    """Continue every prompt (token ids) by up to ``max_new_tokens`` tokens.

    ``tau``: where tau comes from (``losses.tau_source``; None: ``model.tempnet``). A
    sequence stops early at ``eod`` (which is kept in its output). ``on_step(n)`` is called when
    every sequence of a batch has its ``n``-th token (benchmarks time the steps with it).
    ``on_tokens(n)`` reports progress through the ``len(prompts) * max_new_tokens`` token
    budget: ``n`` more positions are generated, or left out because their sequences stopped.
    """
    if tau is None:
        if model.tempnet is None:
            raise GenerationError("the checkpoint has no TempNet: give a fixed tau or --tempnet")
        tau = TempNetTau(model.tempnet)
    if micro_batch_size < 1:
        raise GenerationError(f"--micro-batch-size ({micro_batch_size}) must be >= 1")
    sampling.validate()
    check_prompts(model, prompts, max_new_tokens)
    tp = resolve_tp_group(model.tp_group)
    padded = model.model.padded_vocab_size(tp.size)
    chooser = TokenChooser(sampling, model.vocab_size, tp, padded // tp.size)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results: list[Generated | None] = [None] * len(prompts)
    for first in range(0, len(order), micro_batch_size):
        batch = order[first : first + micro_batch_size]
        outputs = _generate_batch(
            model,
            [prompts[i] for i in batch],
            batch,
            chooser,
            max_new_tokens=max_new_tokens,
            tau=tau,
            eod=eod,
            kv_cache=kv_cache,
            on_step=on_step,
            on_tokens=on_tokens or (lambda n: None),
        )
        for i, out in zip(batch, outputs):
            results[i] = out
    return results


@torch.inference_mode()
def _generate_batch(
    model: InferenceModel,
    prompts: list[list[int]],
    streams: list[int],
    chooser: TokenChooser,
    *,
    max_new_tokens: int,
    tau: FixedTau | TempNetTau,
    eod: int | None,
    kv_cache: bool,
    on_step,
    on_tokens,
) -> list[Generated]:
    device = next(model.lm.parameters()).device
    b = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    width = int(lengths.max())
    tokens = torch.zeros(b, width + max_new_tokens, dtype=torch.long)  # right-padded
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = torch.tensor(prompt)
    tokens = tokens.to(device)
    if kv_cache:
        cache = model.new_cache(b, width + max_new_tokens)
        cache.at(0)
        positions = torch.arange(width, device=device)[None].expand(b, width)
        logits = model.cached_logits(tokens[:, :width], positions, cache, lengths - 1)
    else:
        logits = model.last_logits(tokens[:, :width], lengths)
    outputs = [Generated([], [], False) for _ in prompts]
    active = [True] * b
    common = {"vocab_size": model.vocab_size, "tp_group": model.tp_group}
    for step in range(max_new_tokens):
        taus = tau.tau_of(logits, **common)  # [b]
        token = chooser.choose(logits, taus, streams)  # [b], the same on every rank
        chosen, taus = token.tolist(), taus.tolist()
        for i in range(b):
            if active[i]:
                outputs[i].token_ids.append(chosen[i])
                outputs[i].tau.append(taus[i])
                if eod is not None and chosen[i] == eod:
                    outputs[i].stopped_at_eod, active[i] = True, False
        if on_step is not None:
            on_step(step + 1)
        on_tokens(b)
        if not any(active) or step + 1 == max_new_tokens:
            on_tokens(b * (max_new_tokens - step - 1))  # the budget of the stopped sequences
            break
        position = lengths + step  # where each sequence's new token goes
        tokens[torch.arange(b, device=device), position.to(device)] = token.to(device)
        if kv_cache:
            same = bool((position == position[0]).all())
            cache.at(int(position[0]) if same else position)
            logits = model.cached_logits(
                token[:, None].to(device),
                position[:, None].to(device),
                cache,
                torch.zeros(b, dtype=torch.long),
            )
        else:
            logits = model.last_logits(tokens[:, : width + step + 1], position + 1)
    return outputs


def token_texts(detokenize, token_ids: list[int], prompt: list[int] | None = None) -> list[str]:
    """The text each generated token adds (decoding the growing sequence, so that pieces that
    depend on their neighbours, such as SentencePiece's leading spaces, come out right).

    A byte-level BPE splits a multi-byte character over several tokens; decoded on their own,
    the first parts are the replacement character U+FFFD. Such a character belongs to the token
    that completes it: the tokens before it add nothing. Bytes that no later token completes
    (invalid UTF-8, or generation stopped inside a character) stay U+FFFD where they are, as in
    the decoded text. The texts joined are the decoded sequence.
    """
    context = list(prompt or [])
    decoded = [detokenize(context + token_ids[:i]) for i in range(len(token_ids) + 1)]
    texts, done = [], _settled(decoded, 0) if context else ""
    for i, token in enumerate(token_ids, 1):
        now = _settled(decoded, i)
        texts.append(now[len(done) :] if now.startswith(done) else detokenize([token]))
        done = now
    return texts


def long_token_texts(
    detokenize,
    token_ids: list[int],
    prompt: list[int] | None = None,
    *,
    chunk: int = 256,
    context: int = 16,
) -> list[str]:
    """``token_texts`` of a sequence of any length in linear time (tools/evaluate.py's streams).

    The tokens are decoded ``chunk`` at a time after the ``context`` tokens before the chunk
    (SentencePiece's leading space, a character begun earlier) and with the next few tokens after
    it (a character completed later): the texts are ``token_texts``'s wherever no token's text
    depends on more than ``context`` tokens before it.
    """
    ids = list(prompt or []) + list(token_ids)
    texts: list[str] = []
    for start in range(len(prompt or []), len(ids), chunk):
        end = min(start + chunk, len(ids))
        first = max(0, start - context)  # not inside a character: back to its first byte
        while first > 0 and start - first < context + _UTF8_PARTS:
            if not detokenize(ids[first:start]).startswith("\ufffd"):
                break
            first -= 1
        before = ids[first:start]
        texts += token_texts(detokenize, ids[start : end + _UTF8_PARTS], before)[: end - start]
    return texts


_UTF8_PARTS = 3  # a character being decoded waits for at most 3 more bytes (tokens)


def _settled(decoded: list[str], i: int) -> str:
    """``decoded[i]`` without its trailing U+FFFD when one of the next tokens completes them
    into a character."""
    text = decoded[i]
    head = text.rstrip("\ufffd")
    for later in decoded[i + 1 : i + 1 + _UTF8_PARTS] if head != text else ():
        if later.startswith(head) and later[len(head) : len(head) + 1] not in ("", "\ufffd"):
            return head
    return text
