"""The fused output stage: output layer + TempNet + tempered loss, never holding the logits.

Unfused, the last stage of a GPT step computes the logits ``[T, V_pad/tp]`` (float32), keeps them
for TempNet's input, and the loss adds an ``exp`` buffer of the same size. Here the tokens are
processed in chunks of ``chunk_size``: per chunk the logits ``[c, V_pad/tp]`` are computed from
the final hidden states and this rank's output weight, everything the step needs from them is
reduced to per-token values, and the chunk is dropped. The backward pass recomputes each chunk's
logits once and turns them in place into their gradient. No tensor of ``[T, V_pad/tp]`` exists
in either pass; the per-token state is ``[T]`` vectors and TempNet's ``[T, d1]`` projection.

Per chunk, over the tensor-parallel group (the vocabulary is split as megatron-core splits it):

1. MAX all-reduce of the row maxima ``[c]``;
2. with TempNet, one SUM all-reduce of ``[c, d1 + 2]``: ``W1 L`` on the local vocabulary, the
   squared norm of L and the target logit. TempNet's remaining layers
   (``TempNetLM.tau_from_projection``) then give tau ``[c]`` on every rank;
3. one SUM all-reduce of the partial sums ``S`` (and ``Q``) at tau and ``S`` at tau = 1 (the
   reported cross-entropy), plus the target logit without TempNet.

The backward pass needs one SUM all-reduce in all: the hidden states' gradient ``[T, h]``, which
is partial on each vocabulary shard (megatron-core's column-parallel layer does the same).
Everything is exact: the same math (``dro_math``) on the same values as the unfused path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_tempnet.distributed.groups import (
    TPGroup,
    parallel_argmax,
    resolve_tp_group,
    vocab_partition,
)
from megatron_tempnet.losses import dro_math
from megatron_tempnet.losses.newton import optimal_tau

LOSSES = ("ce", "dro", "ts-ce")
CHUNK_ELEMENTS = 1 << 24
"""Default chunk: as many tokens as keep one chunk of logits under this many elements per rank
(64 MiB in float32)."""
_NORM_EPS = 1e-12  # TempNet's input norm floor, as in tempnet.parallel_input


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


@dataclass(frozen=True)
class _Plan:
    """What one call computes (the non-tensor arguments of the autograd function)."""

    loss: str
    rho: float
    vocab_size: int
    tp: TPGroup
    chunk: int
    fixed_tau: float | None
    newton_tau_min: float | None
    tempnet: torch.nn.Module | None
    tau_grad: bool
    """TempNet learns: tau's gradient is needed (training with TempNet)."""
    eval_terms: bool

    @property
    def tau_in_loss(self) -> bool:
        return self.loss != "ce"


class _FusedOutputStage(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, target, hidden, weight, w1, *projection_params):
        cdtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        part = vocab_partition(weight.shape[0], plan.tp.rank, plan.vocab_size)
        n = hidden.shape[0]
        state = _State.empty(n, cdtype, hidden.device, plan.eval_terms)
        graph: list = []  # TempNet's layers after W1, per chunk: (y leaf, tau)
        w1c = None if w1 is None else w1.to(cdtype)
        for r0 in range(0, n, plan.chunk):
            rows = slice(r0, min(r0 + plan.chunk, n))
            logits = _chunk_logits(hidden[rows], weight, cdtype)  # [c, V_pad/tp]
            _forward_chunk(plan, part, logits, target[rows], w1c, state, rows, graph)
            del logits
        ctx.plan, ctx.part, ctx.graph = plan, part, graph
        ctx.n_projection = len(projection_params)
        ctx.save_for_backward(
            hidden,
            weight,
            w1,
            target,
            state.tau,
            state.row_max,
            state.sum_exp,
            state.dtau,
            state.norm,
        )
        outputs = state.outputs()
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        hidden, weight, w1, target, tau, row_max, sum_exp, dtau, norm = ctx.saved_tensors
        plan, part, needs = ctx.plan, ctx.part, ctx.needs_input_grad
        cdtype = row_max.dtype
        g = grad_loss.to(cdtype)
        grad_y, projection_grads = None, [None] * ctx.n_projection
        if ctx.graph:
            grad_y, projection_grads = _tempnet_backward(ctx, g * dtau)
        grad_hidden = torch.zeros_like(hidden) if needs[2] else None
        grad_weight = None
        if needs[3]:  # float32 accumulation over the chunks, also for 16-bit weights
            acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
            grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        grad_w1 = torch.zeros(w1.shape, dtype=cdtype, device=w1.device) if needs[4] else None
        w1c = None if w1 is None else w1.to(cdtype)
        # the loss's d/dL: g * (softmax(L / tau) - onehot) (ts-ce: g / tau; ce: tau = 1)
        row_scale = g / tau if plan.loss == "ts-ce" else g
        loss_tau = tau if plan.tau_in_loss else torch.ones_like(tau)
        for r0 in range(0, hidden.shape[0], plan.chunk):
            rows = slice(r0, min(r0 + plan.chunk, hidden.shape[0]))
            h_c = hidden[rows]
            logits = _chunk_logits(h_c, weight, cdtype)
            x = logits[:, : part.n_true]
            scaled = None
            if grad_y is not None:
                scaled = grad_y[rows] / norm[rows, None]  # [c, d1]: dTempNet/dy / ||L||
                if grad_w1 is not None:
                    grad_w1.addmm_(scaled.t(), x)
            if grad_hidden is None and grad_weight is None:
                continue
            logit_coef = None
            if scaled is not None and not plan.tempnet.stop_grad:
                # d(W1 L / ||L||)/dL: (g_y W1 - <g_y, y> L / ||L||) / ||L||
                y = ctx.graph_y[rows]
                logit_coef = -(scaled * y).sum(dim=1) / norm[rows]
            dro_math.tempered_softmax_(
                x, row_max[rows], loss_tau[rows], row_scale[rows] / sum_exp[rows], logit_coef
            )
            _, is_local, index = dro_math.gather_target_logits(
                x, target[rows], part.start, part.n_true
            )
            if part.n_true:
                local_rows = torch.arange(x.shape[0], device=x.device)
                zero = torch.zeros_like(row_scale[rows])
                x[local_rows, index] -= torch.where(is_local, row_scale[rows], zero)
            if logit_coef is not None:
                x.addmm_(scaled, w1c)
            logits[:, part.n_true :] = 0.0  # padded vocabulary columns carry no gradient
            grad_logits = logits.to(hidden.dtype)
            del logits
            if grad_hidden is not None:
                torch.matmul(grad_logits, weight, out=grad_hidden[rows])
            if grad_weight is not None:
                _accumulate(grad_weight, grad_logits.t(), h_c)
        if grad_hidden is not None:
            plan.tp.all_reduce(grad_hidden)  # each vocabulary shard's part of dL/dh
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_w1 is not None:
            grad_w1 = grad_w1.to(w1.dtype)
        return (None, None, grad_hidden, grad_weight, grad_w1, *projection_grads)


def _tempnet_backward(ctx, grad_tau: torch.Tensor):
    """Backpropagate tau's gradient through TempNet's layers after W1 (recorded per chunk):
    the gradient of ``y = W1 Lbar`` ``[T, d1]`` and of those layers' parameters."""
    plan = ctx.plan
    leaves = [y for y, _ in ctx.graph]
    taus = [tau for _, tau in ctx.graph]
    ctx.graph_y = torch.cat([y.detach() for y in leaves])
    grads_out = list(grad_tau.split([t.shape[0] for t in taus]))
    params = plan.tempnet.projection_parameters()
    wanted = [p for p, need in zip(params, ctx.needs_input_grad[5:]) if need]
    grads = torch.autograd.grad(
        taus,
        leaves + wanted,
        [g.to(t.dtype) for g, t in zip(grads_out, taus)],
        allow_unused=True,
    )
    grad_y = torch.cat([gy.to(ctx.graph_y.dtype) for gy in grads[: len(leaves)]])
    by_param = iter(grads[len(leaves) :])
    projection_grads = [next(by_param) if need else None for need in ctx.needs_input_grad[5:]]
    ctx.graph = []  # the recorded graph is used once
    return grad_y, projection_grads


@dataclass
class _State:
    """Per-token results of the forward pass, ``[T]`` each."""

    loss: torch.Tensor
    ce: torch.Tensor
    tau: torch.Tensor
    row_max: torch.Tensor
    sum_exp: torch.Tensor  # S at the loss's tau (tau = 1 for --loss ce)
    dtau: torch.Tensor
    norm: torch.Tensor  # ||L|| over the true vocabulary (TempNet's input)
    ts_ce: torch.Tensor | None
    argmax: torch.Tensor | None

    @classmethod
    def empty(cls, n: int, dtype, device, eval_terms: bool) -> _State:
        vectors = [torch.zeros(n, dtype=dtype, device=device) for _ in range(7)]
        extra = [None, None]
        if eval_terms:
            extra = [torch.zeros(n, dtype=dtype, device=device)]
            extra.append(torch.zeros(n, dtype=torch.int64, device=device))
        return cls(*vectors, *extra)

    def outputs(self) -> tuple[torch.Tensor, ...]:
        out = (self.loss, self.ce, self.tau)
        return out + ((self.ts_ce, self.argmax) if self.ts_ce is not None else ())


def _chunk_logits(h_c: torch.Tensor, weight: torch.Tensor, dtype) -> torch.Tensor:
    """``[c, h] x [V_pad/tp, h]^T`` in the LM's dtype (as its output layer), then ``dtype``."""
    return torch.matmul(h_c, weight.t()).to(dtype)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(torch.matmul(a, b))


def _forward_chunk(plan: _Plan, part, logits, target, w1c, state: _State, rows, graph) -> None:
    """The chunk's per-token values into ``state`` (``logits [c, V_pad/tp]`` is not kept)."""
    tp, x = plan.tp, logits[:, : part.n_true]
    row_max = torch.amax(x, dim=1) if part.n_true else x.new_full((x.shape[0],), -math.inf)
    tp.all_reduce(row_max, op=dist.ReduceOp.MAX)
    target_logit, _, _ = dro_math.gather_target_logits(x, target, part.start, part.n_true)
    if plan.tempnet is not None:
        bundle = torch.empty(x.shape[0], w1c.shape[0] + 2, dtype=x.dtype, device=x.device)
        torch.matmul(x, w1c.t(), out=bundle[:, :-2])
        bundle[:, -2] = torch.linalg.vector_norm(x, dim=1).square()
        bundle[:, -1] = target_logit
        tp.all_reduce(bundle)  # TempNet's input and the target logit, one all-reduce
        norm = bundle[:, -2].sqrt().clamp_min(_NORM_EPS)
        tau = _tempnet_tau(plan, bundle[:, :-2] / norm[:, None], graph)
        target_logit = bundle[:, -1]
        state.norm[rows] = norm
    elif plan.newton_tau_min is not None:
        tau = optimal_tau(
            logits,
            rho=plan.rho,
            tau_min=plan.newton_tau_min,
            vocab_size=plan.vocab_size,
            tp_group=tp.group,
        ).to(x.dtype)
    else:
        tau = torch.full_like(row_max, plan.fixed_tau)
    _reduce_sums(plan, x, row_max, tau, target_logit, state, rows)
    if state.argmax is not None:
        state.argmax[rows] = parallel_argmax(x, part.start, tp)


def _tempnet_tau(plan: _Plan, y: torch.Tensor, graph: list) -> torch.Tensor:
    """TempNet's layers after ``W1 Lbar``; recorded for the backward pass when TempNet learns."""
    if not plan.tau_grad:
        return plan.tempnet.tau_from_projection(y).to(y.dtype)
    y = y.detach().requires_grad_()
    with torch.enable_grad():
        tau = plan.tempnet.tau_from_projection(y)
    graph.append((y, tau))
    return tau.detach().to(y.dtype)


def _reduce_sums(plan: _Plan, x, row_max, tau, target_logit, state: _State, rows) -> None:
    """S (and Q) at tau and S at tau = 1 in one all-reduce; the chunk's values from them."""
    need_q = plan.tau_grad
    s_one, _ = dro_math.tempered_sums(x, row_max, torch.ones_like(tau), need_q=False)
    columns = [s_one]
    if plan.tau_in_loss or state.ts_ce is not None:
        s_tau, q_tau = dro_math.tempered_sums(x, row_max, tau, need_q=need_q)
        columns += [s_tau] + ([q_tau] if need_q else [])
    if plan.tempnet is None:
        columns.append(target_logit)
    sums = torch.stack(columns, dim=1)  # [c, 1 to 4]
    plan.tp.all_reduce(sums)
    if plan.tempnet is None:
        target_logit = sums[:, -1]
    margin = row_max - target_logit  # M - L_+
    ce = torch.log(sums[:, 0]) + margin
    state.ce[rows], state.tau[rows], state.row_max[rows] = ce, tau, row_max
    if not plan.tau_in_loss:
        state.loss[rows], state.sum_exp[rows] = ce, sums[:, 0]
    else:
        s_tau = sums[:, 1]
        log_s = torch.log(s_tau)
        state.sum_exp[rows] = s_tau
        if plan.loss == "dro":
            log_c = math.log(plan.vocab_size)
            state.loss[rows] = dro_math.dro_value(log_s, margin, tau, log_c, plan.rho)
            if need_q:
                state.dtau[rows] = dro_math.dro_dtau(log_s, sums[:, 2] / s_tau, log_c, plan.rho)
        else:
            state.loss[rows] = dro_math.ts_ce_value(log_s, margin, tau)
            if need_q:
                state.dtau[rows] = dro_math.ts_ce_dtau(sums[:, 2] / s_tau, margin, tau)
    if state.ts_ce is not None:
        state.ts_ce[rows] = dro_math.ts_ce_value(torch.log(sums[:, 1]), margin, tau)


def fused_output_stage(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    loss: str,
    vocab_size: int,
    rho: float = 0.0,
    tau: float | None = None,
    tempnet: torch.nn.Module | None = None,
    newton_tau_min: float | None = None,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    eval_terms: bool = False,
    tempnet_params: tuple[torch.Tensor, ...] | None = None,
) -> StageOutputs:
    """Output layer, temperature and per-token loss, chunk by chunk (module docstring).

    Args:
        hidden: ``[..., h]`` final hidden states (after the final norm), any float dtype.
        weight: ``[V_pad/tp, h]`` this rank's slice of the output layer (tied or not).
        target: ``[...]`` token ids in ``[0, vocab_size)``.
        loss: ``dro`` (eq. 2), ``ts-ce`` (cross-entropy of ``L / tau``) or ``ce``.
        vocab_size: the true vocabulary ``|C|``; padded columns are excluded everywhere.
        rho: eq. (2)'s constant (``dro``; and Newton's).
        tau / tempnet / newton_tau_min: where tau comes from, exactly one: a constant, a
            ``TempNetLM`` (``stop_grad`` as it is set), or each token's minimiser of eq. (2)
            over ``tau >= newton_tau_min`` (no gradient).
        tp_group: the tensor-parallel group the vocabulary is split over (None: no TP).
        chunk_size: tokens per chunk (default ``default_chunk_size``).
        eval_terms: also return ``ts_ce`` and ``argmax`` (evaluation, without gradients).
        tempnet_params: stand-ins for ``[tempnet.weight1, *tempnet.projection_parameters()]``
            that receive their gradients (views made by a pipeline stage); default: those.
    Returns:
        ``StageOutputs``: float32 values (float64 for float64 hidden states), identical on all
        TP ranks. Gradients reach ``hidden``, ``weight`` and TempNet's parameters.
    """
    sources = [tau is not None, tempnet is not None, newton_tau_min is not None]
    if sum(sources) != 1:
        raise ValueError("give exactly one of tau, tempnet and newton_tau_min")
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r} is not one of {', '.join(LOSSES)}")
    if rho < 0:
        raise ValueError(f"rho ({rho}) must be >= 0")
    if tau is not None and not tau > 0:
        raise ValueError(f"tau ({tau}) must be > 0")
    tp = resolve_tp_group(tp_group)
    _check_shapes(hidden, weight, target, vocab_size, tp)
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_size ({chunk_size}) must be >= 1 token")
    tau_grad = (
        tempnet is not None
        and torch.is_grad_enabled()
        and loss != "ce"
        and any(p.requires_grad for p in tempnet.parameters())
    )
    plan = _Plan(
        loss,
        float(rho),
        vocab_size,
        tp,
        chunk,
        tau,
        newton_tau_min,
        tempnet,
        tau_grad,
        eval_terms,
    )
    lead = target.shape
    w1, params = None, []
    if tempnet is not None:
        w1, *params = tempnet_params or [tempnet.weight1, *tempnet.projection_parameters()]
    out = _FusedOutputStage.apply(
        plan,
        target.reshape(-1).long(),
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        w1,
        *params,
    )
    values = [t.view(lead) for t in out]
    return StageOutputs(*values)


def _check_shapes(hidden, weight, target, vocab_size: int, tp: TPGroup) -> None:
    if tuple(hidden.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} disagree: hidden "
            f"must be target's shape plus the hidden size"
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
