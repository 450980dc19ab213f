"""One chunk of the fused output stage (``output_stage.py``): its forward values and gradients.

A chunk (``Chunk``) is ``c`` tokens: their hidden states, their logits ``[c, V_pad/tp]`` on this
rank's vocabulary shard and their targets. The forward pass reduces the logits to per-token values
(``State``); ``chunk_gradients`` turns them in place into the gradient of ``sum_t g_t loss_t``
(``g``: the loss's upstream gradient) and adds what follows from it to ``Gradients``. Rows are
given as a slice (consecutive tokens) or as an index tensor (scattered tokens), in the stage's
order of the tokens (``output_rows``: the tokens' own order unless sequence parallel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_tempnet.distributed.groups import TPGroup, VocabPartition, parallel_argmax
from megatron_tempnet.losses import dro_math, logit_passes
from megatron_tempnet.losses.output_rows import Rows, WholeRows
from megatron_tempnet.losses.tau_source import TauSource, TempNetTau

_NORM_EPS = 1e-12  # TempNet's input norm floor, as in tempnet.parallel_input


@dataclass(frozen=True)
class Plan:
    """What one call computes (the non-tensor arguments of the autograd function)."""

    loss: str
    rho: float
    vocab_size: int
    tp: TPGroup
    chunk: int
    source: TauSource
    tau_grad: bool
    """TempNet learns: tau's gradient is needed (training with TempNet)."""
    eval_terms: bool
    eager: bool
    """Compute the gradients in the forward pass, while each chunk's logits are at hand."""
    sequence_parallel: bool = False
    """The hidden states are this TP rank's sequence shard (``output_rows.ShardedRows``)."""
    upstream_mask: torch.Tensor | None = None
    """``[T]`` 0/1 in the tokens' order, the one tensor of a plan: the loss's upstream gradient
    is ``c * upstream_mask`` for one scalar ``c`` (``output_stage``'s wait-free backward)."""

    @property
    def tau_in_loss(self) -> bool:
        return self.loss != "ce"

    @property
    def tempnet(self) -> torch.nn.Module | None:
        """The ``TempNetLM`` tau comes from, or None."""
        return self.source.tempnet if isinstance(self.source, TempNetTau) else None


@dataclass
class State:
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
    def empty(cls, n: int, dtype, device, eval_terms: bool) -> State:
        vectors = [torch.zeros(n, dtype=dtype, device=device) for _ in range(7)]
        extra = [None, None]
        if eval_terms:
            extra = [torch.zeros(n, dtype=dtype, device=device)]
            extra.append(torch.zeros(n, dtype=torch.int64, device=device))
        return cls(*vectors, *extra)

    def outputs(self) -> tuple[torch.Tensor, ...]:
        out = (self.loss, self.ce, self.tau)
        return out + ((self.ts_ce, self.argmax) if self.ts_ce is not None else ())

    def forward_values(self, rows: Rows) -> ForwardValues:
        """What the gradients of ``rows`` need of this state."""
        return ForwardValues(self.tau, self.row_max, self.sum_exp, self.norm).select(rows)


@dataclass
class ForwardValues:
    """What a chunk's gradients need of the forward pass, per token of its rows."""

    tau: torch.Tensor
    row_max: torch.Tensor
    sum_exp: torch.Tensor
    norm: torch.Tensor
    y: torch.Tensor | None = None
    """TempNet's ``W1 Lbar`` (without stop-gradient)."""
    grad_y: torch.Tensor | None = None
    """d/dy of ``sum_t g_t loss_t`` through tau (TempNet learning)."""
    dtau: torch.Tensor | None = None
    """d loss / d tau, every token's (the backward pass's TempNet gradient)."""

    def select(self, rows: Rows) -> ForwardValues:
        """The values of ``rows`` (without ``y``, ``grad_y`` and ``dtau``)."""
        return ForwardValues(
            self.tau[rows], self.row_max[rows], self.sum_exp[rows], self.norm[rows]
        )


@dataclass
class Chunk:
    """One chunk of tokens and every tensor its values and gradients are computed from."""

    rows: Rows
    """The chunk's tokens: a slice of the stage order, or an index tensor into it."""
    hidden: torch.Tensor
    """``[c, h]`` their final hidden states, in the LM's dtype."""
    logits: torch.Tensor
    """``[c, V_pad/tp]`` in the compute dtype (``chunk_logits``); ``chunk_gradients`` overwrites
    them with the loss's gradient."""
    targets: torch.Tensor
    """``[c]`` their target token ids."""
    output_weight: torch.Tensor
    """``[V_pad/tp, h]`` this rank's slice of the output layer."""
    vocab: VocabPartition
    """This rank's vocabulary shard: its first token id and its true (unpadded) columns."""
    tempnet_w1: torch.Tensor | None = None
    """``[d1, n_true]`` TempNet's first weight in the compute dtype (None without TempNet)."""
    tempnet_w1_logits: torch.Tensor | None = None
    """``[c, d1]`` TempNet's ``W1 L`` on this rank's vocabulary when the caller formed it
    through the output weight (``w1_through_weight``); None: formed from the logits."""


@dataclass
class Gradients:
    """Gradients of ``sum_t g_t loss_t``, summed over chunks."""

    hidden: torch.Tensor | None
    """``[T, h]``: this vocabulary shard's part (summed over the TP group at the end); with
    sequence parallelism ``[T/tp, h]``, this rank's rows, complete."""
    weight: torch.Tensor | None
    """``[V_pad/tp, h]`` float32 accumulator (float64 for float64 weights)."""
    w1: torch.Tensor | None
    projection: list
    """TempNet's parameters after ``W1`` (None where not wanted)."""
    layout: WholeRows
    """Where the hidden states' rows are (``output_rows``)."""
    w1_h: torch.Tensor | None = None
    """``[d1, h]``: W1's gradient before the output weight, ``sum_t (g_y / ||L||)_t h_t^T``,
    when TempNet's product is factored (``w1_through_weight``); ``finish`` multiplies it by
    the weight's true rows."""

    @classmethod
    def zeros(
        cls,
        needs_grad,
        hidden,
        weight,
        w1,
        dtype,
        *,
        eager: bool,
        layout: WholeRows,
        factored: bool = False,
    ) -> Gradients:
        """Zero gradients for the inputs that need one (``needs_grad``: the autograd function's
        ``needs_input_grad``), TempNet's in the compute ``dtype``. 16-bit hidden gradients
        computed eagerly stay float32 until the backward pass has scaled them. ``factored``:
        W1's gradient goes through ``w1_h``."""
        grad_hidden = grad_weight = grad_w1 = w1_h = None
        if needs_grad[2]:
            wide = hidden.dtype in (torch.float32, torch.float64) or not eager
            hidden_dtype = hidden.dtype if wide else torch.float32
            grad_hidden = torch.zeros(hidden.shape, dtype=hidden_dtype, device=hidden.device)
        if needs_grad[3]:  # float32 accumulation over the chunks, also for 16-bit weights
            acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
            grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        if needs_grad[4] and factored:
            w1_h = torch.zeros(w1.shape[0], hidden.shape[-1], dtype=dtype, device=w1.device)
        elif needs_grad[4]:
            grad_w1 = torch.zeros(w1.shape, dtype=dtype, device=w1.device)
        projection = [None] * len(needs_grad[5:])
        return cls(grad_hidden, grad_weight, grad_w1, projection, layout, w1_h)

    def add_projection(self, grads) -> None:
        for i, grad in enumerate(grads):
            if grad is not None:
                known = self.projection[i]
                self.projection[i] = grad if known is None else known + grad

    def scale_(self, c: torch.Tensor) -> None:
        for t in [self.hidden, self.weight, self.w1, self.w1_h, *self.projection]:
            if t is not None:
                t.mul_(c.to(t.dtype))

    def finish(self, hidden, weight, w1) -> tuple:
        """The gradients in the inputs' dtypes, the hidden states' summed over the TP group."""
        grad_hidden, grad_weight, grad_w1 = self.hidden, self.weight, self.w1
        if self.w1_h is not None:  # [d1, h] x [h, n_true]: the true rows are the local first
            grad_w1 = self.w1_h @ weight[: w1.shape[1]].to(self.w1_h.dtype).t()
        if grad_hidden is not None:
            self.layout.finish(grad_hidden)  # each vocabulary shard's part of dL/dh
            grad_hidden = grad_hidden.to(hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_w1 is not None:
            grad_w1 = grad_w1.to(w1.dtype)
        return (grad_hidden, grad_weight, grad_w1, *self.projection)


def w1_through_weight(
    plan: Plan, tempnet_w1, weight, n_true: int, tokens: int
) -> torch.Tensor | None:
    """``W1 W_true`` ``[d1, h]`` (this rank's vocabulary), when forming TempNet's product as
    ``h (W1 W_true)^T`` costs less than ``L W1^T``; None otherwise.

    ``W1 L = W1 (W_true h) = (W1 W_true) h``: one ``[d1, V] x [V, h]`` product per call and
    ``[c, h] x [h, d1]`` per chunk, instead of ``[c, V] x [V, d1]`` per chunk, and W1's gradient
    ``(g_y / ||L||)^T L = ((g_y / ||L||)^T H) W_true`` likewise. Fewer multiply-adds when the
    call has more than ``V h / (V - h)`` tokens (about ``h``). Only with the stop-gradient
    (TempNet's input is then a function of ``h`` alone for every gradient); the same math, its
    sums associated in another order.
    """
    if plan.tempnet is None or not plan.tempnet.stop_grad or n_true <= weight.shape[1]:
        return None
    if tokens * (n_true - weight.shape[1]) <= n_true * weight.shape[1]:
        return None
    return tempnet_w1 @ weight[:n_true].to(tempnet_w1.dtype)


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype) -> torch.Tensor:
    """``[c, h] x [V_pad/tp, h]^T`` in the LM's dtype (as its output layer), then ``dtype``."""
    return torch.matmul(hidden, weight.t()).to(dtype)


def forward_chunk(plan: Plan, chunk: Chunk, state: State, graph: list) -> None:
    """The chunk's per-token values into ``state`` (``chunk.logits`` is not changed). With a
    learning TempNet its layers after ``W1`` are recorded in ``graph`` (``_tempnet_tau``)."""
    tp, vocab = plan.tp, chunk.vocab
    true_logits = chunk.logits[:, : vocab.n_true]  # [c, n_true]
    tokens = true_logits.shape[0]
    if vocab.n_true:
        row_max, norm_sq = logit_passes.row_stats(true_logits, need_norm=plan.tempnet is not None)
    else:
        row_max = true_logits.new_full((tokens,), -math.inf)
        norm_sq = true_logits.new_zeros(tokens)
    tp.all_reduce(row_max, op=dist.ReduceOp.MAX)
    target_logit, _, _ = dro_math.gather_target_logits(
        true_logits, chunk.targets, vocab.start, vocab.n_true
    )
    if plan.tempnet is not None:
        w1 = chunk.tempnet_w1
        bundle = torch.empty(
            tokens, w1.shape[0] + 2, dtype=true_logits.dtype, device=true_logits.device
        )
        if chunk.tempnet_w1_logits is None:
            torch.matmul(true_logits, w1.t(), out=bundle[:, :-2])
        else:
            bundle[:, :-2] = chunk.tempnet_w1_logits
        bundle[:, -2] = norm_sq
        bundle[:, -1] = target_logit
        tp.all_reduce(bundle)  # TempNet's input and the target logit, one all-reduce
        norm = bundle[:, -2].sqrt().clamp_min(_NORM_EPS)
        tau = _tempnet_tau(plan, bundle[:, :-2] / norm[:, None], graph)
        target_logit = bundle[:, -1]
        state.norm[chunk.rows] = norm
    else:
        tau = plan.source.tau_of(chunk.logits, vocab_size=plan.vocab_size, tp_group=tp.group)
        tau = tau.to(true_logits.dtype)
    _reduce_sums(plan, true_logits, row_max, tau, target_logit, state, chunk.rows)
    if state.argmax is not None:
        state.argmax[chunk.rows] = parallel_argmax(true_logits, vocab.start, tp)


def _tempnet_tau(plan: Plan, y: torch.Tensor, graph: list) -> torch.Tensor:
    """TempNet's layers after ``W1 Lbar``; recorded for the backward pass when TempNet learns."""
    if not plan.tau_grad:
        return plan.tempnet.tau_from_projection(y, module_hooks=False).to(y.dtype)
    y = y.detach().requires_grad_()
    with torch.enable_grad():
        tau = plan.tempnet.tau_from_projection(y, module_hooks=False)
    graph.append((y, tau))
    return tau.detach().to(y.dtype)


def _reduce_sums(
    plan: Plan, true_logits, row_max, tau, target_logit, state: State, rows: Rows
) -> None:
    """S (and Q) at tau and S at tau = 1 in one all-reduce; the chunk's values from them."""
    need_q = plan.tau_grad
    at_tau = plan.tau_in_loss or state.ts_ce is not None
    s_one, s_tau, q_tau = logit_passes.exp_sums(
        true_logits, row_max, tau, at_tau=at_tau, need_q=need_q
    )
    columns = [s_one]
    if at_tau:
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


def tempnet_backward(plan: Plan, graph: list, grad_tau: torch.Tensor, wanted, *, keep: bool):
    """Backpropagate tau's gradient ``[n]`` through TempNet's layers after ``W1`` recorded for
    ``graph``'s chunks (``n`` tokens in all): the gradient of ``y = W1 Lbar`` ``[n, d1]`` and of
    those layers' parameters (``wanted``: which; None where not). ``keep`` keeps the graph."""
    leaves = [y for y, _ in graph]
    taus = [tau for _, tau in graph]
    params = [p for p, want in zip(plan.tempnet.projection_parameters(), wanted) if want]
    grads_out = grad_tau.split([t.shape[0] for t in taus])
    grads = torch.autograd.grad(
        taus,
        leaves + params,
        [g.to(t.dtype) for g, t in zip(grads_out, taus)],
        retain_graph=keep,
        allow_unused=True,
    )
    grad_y = torch.cat([gy.to(grad_tau.dtype) for gy in grads[: len(leaves)]])
    by_param = iter(grads[len(leaves) :])
    return grad_y, [next(by_param) if want else None for want in wanted]


def chunk_gradients(
    plan: Plan, chunk: Chunk, grad_loss: torch.Tensor, values: ForwardValues, grads: Gradients
) -> None:
    """Turn the chunk's logits ``[c, V_pad/tp]`` (overwritten) into d(sum_t g_t loss_t)/dL, for
    the loss's upstream gradient ``grad_loss`` (``g``, ``[c]``), and add W1's, the hidden rows'
    and the output weight's gradients that follow from it to ``grads``.

    The loss's d/dL is ``g * (softmax(L / tau) - onehot)`` (ts-ce: ``g / tau``; ce: tau = 1);
    without stop-gradient, tau's path through TempNet's normalised input adds to it.
    """
    vocab, logits = chunk.vocab, chunk.logits
    true_logits = logits[:, : vocab.n_true]  # [c, n_true], a view: becomes d/dL in place
    scaled_grad_y = None
    if values.grad_y is not None:
        scaled_grad_y = values.grad_y / values.norm[:, None]  # [c, d1]: dTempNet/dy / ||L||
        if grads.w1 is not None:
            grads.w1.addmm_(scaled_grad_y.t(), true_logits)
        elif grads.w1_h is not None:
            grads.w1_h.addmm_(scaled_grad_y.t(), chunk.hidden.to(scaled_grad_y.dtype))
    if grads.hidden is None and grads.weight is None:
        return
    logit_coef = None
    if scaled_grad_y is not None and not plan.tempnet.stop_grad:
        # d(W1 L / ||L||)/dL: (g_y W1 - <g_y, y> L / ||L||) / ||L||
        logit_coef = -(scaled_grad_y * values.y).sum(dim=1) / values.norm
    row_scale = grad_loss / values.tau if plan.loss == "ts-ce" else grad_loss
    loss_tau = values.tau if plan.tau_in_loss else torch.ones_like(values.tau)
    row_factor = row_scale / values.sum_exp
    logit_passes.tempered_softmax_(true_logits, values.row_max, loss_tau, row_factor, logit_coef)
    _, is_local, index = dro_math.gather_target_logits(
        true_logits, chunk.targets, vocab.start, vocab.n_true
    )
    if vocab.n_true:
        local_rows = torch.arange(true_logits.shape[0], device=true_logits.device)
        target_scale = torch.where(is_local, row_scale, torch.zeros_like(row_scale))
        true_logits[local_rows, index] -= target_scale
    if logit_coef is not None:
        true_logits.addmm_(scaled_grad_y, chunk.tempnet_w1)
    logits[:, vocab.n_true :] = 0.0  # padded vocabulary columns carry no gradient
    grad_logits = logits.to(chunk.hidden.dtype)  # [c, V_pad/tp]
    if grads.hidden is not None:
        grads.layout.add_grad(grads.hidden, chunk.rows, grad_logits, chunk.output_weight)
    if grads.weight is not None:
        if grad_logits.dtype == grads.weight.dtype:
            grads.weight.addmm_(grad_logits.t(), chunk.hidden)
        else:
            grads.weight.add_(torch.matmul(grad_logits.t(), chunk.hidden))
