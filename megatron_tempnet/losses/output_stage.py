"""The fused output stage: output layer + TempNet + tempered loss, never holding the logits.

Unfused, the last stage of a GPT step computes the logits ``[T, V_pad/tp]`` (float32), keeps them
for TempNet's input, and the loss adds an ``exp`` buffer of the same size. Here the tokens are
processed in chunks of ``chunk_size``: per chunk the logits ``[c, V_pad/tp]`` are computed from
the final hidden states and this rank's output weight, everything the step needs from them is
reduced to per-token values, and the chunk is dropped. No tensor of ``[T, V_pad/tp]`` exists in
either pass; the per-token state is ``[T]`` vectors and TempNet's ``[T, d1]`` projection.

The gradients are computed in the forward pass, from each chunk's logits while they exist, for
the loss's upstream gradient ``g = 1``. The backward pass scales them by the value most tokens'
``g`` has (training: ``1 / tokens`` on every unmasked token) and recomputes the logits only of
the tokens whose ``g`` differs (the masked ones), adding their share. Per token this is the
unfused path's work: one output GEMM forward and two for the gradients. Finding that value and
those tokens reads ``g`` on the host (``unique``, ``nonzero``: two waits for the device per
call). A training step knows better: its upstream gradient is ``c * mask`` (the masked mean over
the global batch's tokens), so given the mask (``upstream_mask``) the forward pass computes the
gradients of ``sum_t mask_t loss_t``, nothing is recomputed, and the backward pass only
multiplies by ``c``, taken on the device: no wait at all. A ``g`` of another form is refused
there, by an assertion the device checks without the host waiting.

Per chunk, over the tensor-parallel group (the vocabulary is split as megatron-core splits it):

1. MAX all-reduce of the row maxima ``[c]``;
2. with TempNet, one SUM all-reduce of ``[c, d1 + 2]``: ``W1 L`` on the local vocabulary, the
   squared norm of L and the target logit. TempNet's remaining layers
   (``TempNetLM.tau_from_projection``) then give tau ``[c]`` on every rank;
3. one SUM all-reduce of the partial sums ``S`` (and ``Q``) at tau and ``S`` at tau = 1 (the
   reported cross-entropy), plus the target logit without TempNet.

The gradients need one SUM all-reduce in all, in the backward pass: the hidden states' gradient
``[T, h]``, which is partial on each vocabulary shard (megatron-core's column-parallel layer does
the same).
Everything is exact: the same math (``dro_math``) on the same values as the unfused path. With a
stop-gradient TempNet and more tokens than about the hidden size, TempNet's first product is
formed through the output weight, ``W1 L = (W1 W) h`` (``output_chunks.w1_through_weight``): the
same sums in another order, with ``[d1, V] x [V, h]`` once per call instead of ``[c, V] x [V,
d1]`` per chunk, in both passes (setting iii's largest cost after the LM itself).

With sequence parallelism (``sequence_parallel=True``) each rank holds its sequence shard
``[s/tp, b, h]`` of the hidden states: a chunk gathers ``c/tp`` rows from every rank (one
all-gather of ``[c/tp, h]``), is computed as above, and its ``dL/dh`` is reduce-scattered back to
the rows' owners instead of the final all-reduce; no rank holds ``[T, h]`` hidden states or
gradients (``output_rows``). The per-token outputs are every token's, on every rank, as without.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_tempnet.distributed.groups import (
    TPGroup,
    VocabPartition,
    resolve_tp_group,
    vocab_partition,
)
from megatron_tempnet.losses.output_chunks import (
    Chunk,
    ForwardValues,
    Gradients,
    Plan,
    State,
    chunk_gradients,
    chunk_logits,
    forward_chunk,
    tempnet_backward,
    w1_through_weight,
)
from megatron_tempnet.losses.output_rows import Rows, WholeRows, token_rows
from megatron_tempnet.losses.tau_source import TauSource, TempNetTau

LOSSES = ("ce", "dro", "ts-ce")
CHUNK_ELEMENTS = 1 << 25
"""Default chunk: as many tokens as keep one chunk of logits under this many elements per rank
(128 MiB in float32). Chosen with benchmarks/chunk_bench.py (docs/performance.md): the smallest
budget whose stage time is within 10 % of the fastest measured, at SmolLM2's and GPT-2's
shapes."""


def default_chunk_size(partition_size: int) -> int:
    """Tokens per chunk for ``partition_size`` vocabulary columns per rank."""
    return max(1, CHUNK_ELEMENTS // max(partition_size, 1))


@dataclass
class StageOutputs:
    """Per-token values, each shaped like the targets; only ``loss`` carries gradients."""

    loss: torch.Tensor
    ce: torch.Tensor
    """Cross-entropy of the logits (tau = 1), reported."""
    tau: torch.Tensor
    ts_ce: torch.Tensor | None = None
    """Cross-entropy of ``L / tau`` (the T-LLM term), with ``eval_terms``."""
    argmax: torch.Tensor | None = None
    """The most likely token id (ties: the lowest id), with ``eval_terms``."""


@dataclass
class _StageInputs:
    """The call's tensors, from which each chunk's are taken (``chunk``)."""

    layout: WholeRows
    hidden: torch.Tensor
    """``[T, h]`` the final hidden states (sequence parallel: ``[T/tp, h]``, this rank's)."""
    output_weight: torch.Tensor
    targets: torch.Tensor
    """``[T]`` in the stage order."""
    vocab: VocabPartition
    tempnet_w1: torch.Tensor | None
    """TempNet's first weight in the compute dtype."""
    dtype: torch.dtype
    """The compute dtype: float32, or float64 for float64 hidden states."""
    w1_weight: torch.Tensor | None = None
    """``W1 W_true`` when TempNet's product is formed through the output weight."""

    def chunk(self, rows: Rows) -> Chunk:
        """The chunk of ``rows``: its hidden rows (gathered when sequence parallel), logits
        ``[c, V_pad/tp]`` and, with ``w1_weight``, TempNet's ``W1 L`` ``[c, d1]``."""
        hidden = self.layout.rows(self.hidden, rows)  # [c, h]
        logits = chunk_logits(hidden, self.output_weight, self.dtype)  # [c, V_pad/tp]
        w1_logits = None
        if self.w1_weight is not None:
            w1_logits = hidden.to(self.dtype) @ self.w1_weight.t()  # [c, d1]
        return Chunk(
            rows=rows,
            hidden=hidden,
            logits=logits,
            targets=self.targets[rows],
            output_weight=self.output_weight,
            vocab=self.vocab,
            tempnet_w1=self.tempnet_w1,
            tempnet_w1_logits=w1_logits,
        )


class _FusedOutputStage(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: Plan, target, hidden, weight, w1, *projection_params):
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        vocab = vocab_partition(weight.shape[0], plan.tp.rank, plan.vocab_size)
        needs_grad = ctx.needs_input_grad
        layout = token_rows(hidden, plan.tp, plan.chunk, plan.sequence_parallel)
        target = layout.to_stage(target)  # [T] in the order the chunks take the tokens
        state = State.empty(layout.tokens, dtype, hidden.device, plan.eval_terms)
        tempnet_w1 = None if w1 is None else w1.to(dtype)
        w1_weight = w1_through_weight(plan, tempnet_w1, weight, vocab.n_true, layout.tokens)
        inputs = _StageInputs(layout, hidden, weight, target, vocab, tempnet_w1, dtype, w1_weight)
        factored = w1_weight is not None
        weights = None  # g = 1 (or the mask's 0/1) per token in the forward pass's gradients
        if plan.upstream_mask is not None:
            weights = layout.to_stage(plan.upstream_mask).to(dtype)
        grads = None
        if plan.eager and any(needs_grad[2:]):
            grads = Gradients.zeros(
                needs_grad, hidden, weight, w1, dtype, eager=True, layout=layout, factored=factored
            )
        graph: list = []  # TempNet's layers after W1, per chunk: (y leaf, tau)
        for rows in layout.chunks():
            chunk = inputs.chunk(rows)
            recorded = len(graph)
            forward_chunk(plan, chunk, state, graph)
            if grads is not None:
                g = None if weights is None else weights[rows]
                _eager_chunk(plan, chunk, state, graph[recorded:], needs_grad[5:], grads, g)
            del chunk  # this chunk's logits go before the next chunk's are made
        ctx.plan, ctx.vocab, ctx.graph, ctx.grads, ctx.layout = plan, vocab, graph, grads, layout
        ctx.factored, ctx.weights = factored, weights
        saved = [state.tau, state.row_max, state.sum_exp, state.norm, state.dtau]
        ctx.save_for_backward(hidden, weight, w1, target, *saved)
        outputs = tuple(layout.to_tokens(v) for v in state.outputs())
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        if ctx.plan is None:
            raise RuntimeError(
                "the fused output stage's backward pass ran twice on one forward pass (a "
                "retained graph): it frees its state after the first; run the forward pass "
                "again, or use --no-fused-output-stage"
            )
        hidden, weight, w1, target, tau, row_max, sum_exp, norm, dtau = ctx.saved_tensors
        needs_grad, grads, layout = ctx.needs_input_grad, ctx.grads, ctx.layout
        dtype, factored = tau.dtype, ctx.factored  # the compute dtype
        grad_loss = layout.to_stage(grad_loss.to(dtype))  # g, [T] in the stage order
        left, recompute = None, True  # the tokens whose gradients are computed here (all)
        if grads is None:
            grads = Gradients.zeros(
                needs_grad, hidden, weight, w1, dtype, eager=False, layout=layout, factored=factored
            )
        elif ctx.weights is not None:  # g = c * mask: scale by c, found on the device
            grads.scale_(_mask_scale(grad_loss, ctx.weights))
            recompute = False
        else:  # the forward pass's gradients are for g = 1: scale them by g's usual value
            usual = _most_common(grad_loss)  # waits for the device
            grads.scale_(usual)
            grad_loss = grad_loss - usual  # the masked tokens', or any other difference
            left = torch.nonzero(grad_loss).flatten()  # waits for the device
            recompute = left.numel() > 0
        if recompute:
            tempnet_w1 = None if w1 is None else w1.to(dtype)
            inputs = _StageInputs(layout, hidden, weight, target, ctx.vocab, tempnet_w1, dtype)
            saved = ForwardValues(tau, row_max, sum_exp, norm, dtau=dtau)
            _recompute(ctx, inputs, saved, grad_loss, left, grads)
        ctx.graph, ctx.grads, ctx.plan, ctx.layout = [], None, None, None  # used once
        ctx.weights = None
        return (None, None, *grads.finish(hidden, weight, w1))


def _eager_chunk(
    plan: Plan,
    chunk: Chunk,
    state: State,
    graph: list,
    wanted,
    grads: Gradients,
    weights: torch.Tensor | None = None,
) -> None:
    """The chunk's gradients of ``sum_t w_t loss_t`` (the backward pass scales them), ``w``
    the chunk's ``weights`` ``[c]`` (None: 1). ``graph``: the chunk's TempNet layers
    (``forward_chunk``); ``wanted``: which of their parameters need a gradient."""
    values = state.forward_values(chunk.rows)
    g = torch.ones_like(values.tau) if weights is None else weights
    if graph:
        values.y = graph[0][0].detach()
        grad_tau = state.dtau[chunk.rows] * g
        values.grad_y, by_param = tempnet_backward(plan, graph, grad_tau, wanted, keep=True)
        grads.add_projection(by_param)
    chunk_gradients(plan, chunk, g, values, grads)


def _recompute(
    ctx, inputs: _StageInputs, saved: ForwardValues, grad_loss, left, grads: Gradients
) -> None:
    """Add the gradients of ``sum_t g_t loss_t`` (``grad_loss``: g, every token's) over the
    tokens ``left`` (None: all), each chunk's logits computed again."""
    plan = ctx.plan
    grad_y = y = None
    if ctx.graph:
        wanted = ctx.needs_input_grad[5:]
        grad_tau = grad_loss * saved.dtau
        grad_y, by_param = tempnet_backward(plan, ctx.graph, grad_tau, wanted, keep=False)
        grads.add_projection(by_param)
        y = torch.cat([leaf.detach() for leaf, _ in ctx.graph])
    if grads.hidden is None and grads.weight is None and grads.w1 is None and grads.w1_h is None:
        return
    chunks = inputs.layout.chunks() if left is None else left.split(plan.chunk)
    for rows in chunks:
        values = saved.select(rows)
        if grad_y is not None:
            values.y, values.grad_y = y[rows], grad_y[rows]
        chunk_gradients(plan, inputs.chunk(rows), grad_loss[rows], values, grads)


def _mask_scale(g: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``c`` of an upstream gradient ``g = c * mask`` (``[T]`` each, ``mask`` 0/1), a device
    scalar (0 when every token is masked). That ``g`` has this form is asserted on the device,
    without the host waiting for the answer (on a GPU a violation stops the run at its next
    synchronisation)."""
    kept = mask > 0
    c = torch.where(kept, g, -math.inf).amax()  # every kept token has the same g
    c = torch.where(kept.any(), c, 0.0)
    torch._assert_async(
        (g == c * mask).all(),
        "fused output stage: the upstream gradient is not a multiple of upstream_mask",
    )
    return c


def _most_common(g: torch.Tensor) -> torch.Tensor:
    """The value most tokens' gradients have (for ``mean(mask * loss)``: 1 / tokens)."""
    values, counts = torch.unique(g, return_counts=True)
    return values[counts.argmax()]


def fused_output_stage(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    loss: str,
    vocab_size: int,
    tau: TauSource,
    rho: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    eval_terms: bool = False,
    eager_gradients: bool = True,
    sequence_parallel: bool = False,
    upstream_mask: torch.Tensor | None = None,
) -> StageOutputs:
    """Output layer, temperature and per-token loss, chunk by chunk (module docstring).

    Args:
        hidden: ``[..., h]`` final hidden states (after the final norm), any float dtype;
            with ``sequence_parallel`` ``[s/tp, ...]``: this rank's shard of the first
            dimension.
        weight: ``[V_pad/tp, h]`` this rank's slice of the output layer (tied or not).
        target: ``[...]`` token ids in ``[0, vocab_size)`` (with ``sequence_parallel`` every
            token's, ``[s, ...]``).
        loss: ``dro`` (eq. 2), ``ts-ce`` (cross-entropy of ``L / tau``) or ``ce``.
        vocab_size: the true vocabulary ``|C|``; padded columns are excluded everywhere.
        tau: where tau comes from (``losses.tau_source``): a ``FixedTau``, a ``TempNetTau``
            (``stop_grad`` as it is set; its ``params`` receive the gradients) or a
            ``NewtonTau`` (no gradient).
        rho: eq. (2)'s radius (``dro``).
        tp_group: the tensor-parallel group the vocabulary is split over (None: no TP).
        chunk_size: tokens per chunk (default ``default_chunk_size``).
        eval_terms: also return ``ts_ce`` and ``argmax`` (evaluation, without gradients).
        eager_gradients: with gradients to compute, compute them in the forward pass for the
            gradient most tokens' loss receives (module docstring); False: recompute the
            logits in the backward pass.
        sequence_parallel: ``hidden`` is sequence-sharded over ``tp_group`` (module
            docstring); the upstream gradient must be the same on every TP rank.
        upstream_mask: ``[...]`` like ``target``, 0/1: the loss's upstream gradient will be
            ``c * upstream_mask`` for one scalar ``c`` (a training step's masked mean), so the
            backward pass needs no wait for the device (module docstring); with eager
            gradients only. None: any upstream gradient.
    Returns:
        ``StageOutputs``: float32 values (float64 for float64 hidden states), identical on all
        TP ranks (every token's, also with ``sequence_parallel``). Gradients reach ``hidden``,
        ``weight`` and TempNet's parameters.
    """
    _check_arguments(loss, tau, rho)
    tp = resolve_tp_group(tp_group)
    _check_shapes(hidden, weight, target, vocab_size, tp, sequence_parallel)
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_size ({chunk_size}) must be >= 1 token")
    w1, params = None, []
    if isinstance(tau, TempNetTau):
        w1, *params = tau.parameters()
    plan = Plan(
        loss=loss,
        rho=float(rho),
        vocab_size=vocab_size,
        tp=tp,
        chunk=chunk,
        source=tau,
        tau_grad=torch.is_grad_enabled() and loss != "ce" and _learns(tau),
        eval_terms=eval_terms,
        eager=eager_gradients,
        sequence_parallel=sequence_parallel and tp.size > 1,
        upstream_mask=_mask_for(upstream_mask, target, eager_gradients),
    )
    lead = target.shape
    out = _FusedOutputStage.apply(
        plan, target.reshape(-1).long(), hidden.reshape(-1, hidden.shape[-1]), weight, w1, *params
    )
    return StageOutputs(*(t.view(lead) for t in out))


def _check_arguments(loss: str, tau: TauSource, rho: float) -> None:
    if not isinstance(tau, TauSource):
        raise TypeError(f"tau must be a TauSource (FixedTau, NewtonTau, TempNetTau), not {tau!r}")
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r} is not one of {', '.join(LOSSES)}")
    if rho < 0:
        raise ValueError(f"rho ({rho}) must be >= 0")


def _learns(tau: TauSource) -> bool:
    """TempNet's parameters want gradients."""
    return isinstance(tau, TempNetTau) and any(p.requires_grad for p in tau.tempnet.parameters())


def _mask_for(mask: torch.Tensor | None, target: torch.Tensor, eager: bool) -> torch.Tensor | None:
    """``upstream_mask`` as the plan holds it: ``[T]`` floats in the tokens' order, or None."""
    if mask is None or not torch.is_grad_enabled():
        return None
    if tuple(mask.shape) != tuple(target.shape):
        raise ValueError(
            f"upstream_mask {tuple(mask.shape)} must have target's shape {tuple(target.shape)}"
        )
    if not eager:
        raise ValueError("upstream_mask needs eager_gradients (the backward pass recomputes)")
    return mask.reshape(-1).float()


def _check_shapes(hidden, weight, target, vocab_size: int, tp: TPGroup, sharded: bool) -> None:
    lead = list(hidden.shape[:-1])
    if sharded and lead:  # this rank's shard of the first dimension
        lead[0] *= tp.size
    if tuple(lead) != tuple(target.shape):
        shard = f" (x {tp.size} TP ranks along the sequence)" if sharded else ""
        raise ValueError(
            f"hidden {tuple(hidden.shape)}{shard} and target {tuple(target.shape)} disagree: "
            f"hidden must be target's shape plus the hidden size"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight {tuple(weight.shape)} must be [V_pad/tp, {hidden.shape[-1]}] (the output "
            f"layer's slice for hidden size {hidden.shape[-1]})"
        )
    padded = weight.shape[0] * tp.size
    if not 1 <= vocab_size <= padded:
        raise ValueError(
            f"vocab_size ({vocab_size}) must be in [1, {padded}], the padded vocabulary "
            f"({weight.shape[0]} rows per rank x {tp.size} TP ranks)"
        )
