"""TempNet for language models (Section 5, docs/design.md §2), on vocabulary-parallel logits.

    Lbar = L / ||L||_2                  over the true vocabulary, across TP ranks
    v    = sigmoid(W1 Lbar + b1)        W1: d1 x V, split by vocabulary columns over TP ranks
    u    = W2 v                         W2: d2 x d1, replicated
    s    = sum_k (softmax(u/phi)_k - 1/d2) w3_k u_k - b
    tau  = (tau_max - tau_min) sigmoid(s) + tau_min

Parameters: ``V d1 + d1 + d1 d2 + d2 + 2`` (8.26M for V = 32000, d1 = d2 = 256).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from megatron_tempnet.distributed.groups import resolve_tp_group, vocab_partition
from megatron_tempnet.tempnet.layers import (
    ParameterisedPooling,
    bounded_temperature,
    check_tau_range,
)
from megatron_tempnet.tempnet.parallel_input import normalised_parallel_linear
from megatron_tempnet.utils.precision import f32, keep_float32


def _kaiming_uniform_(weight: torch.Tensor, fan_in: int, generator=None) -> torch.Tensor:
    # torch.nn.Linear's default, kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    bound = 1.0 / math.sqrt(fan_in)
    return weight.uniform_(-bound, bound, generator=generator)


class TempNetLM(nn.Module):
    """Predicts a temperature for every token from the LM's vocabulary-parallel logits.

    Args:
        vocab_size: true vocabulary size V (TempNet's input dimension d0).
        hidden_size: d1, width of the transformation layer.
        proj_size: d2, number of prototypical logits.
        tau_min, tau_max: output range ``[tau0, tau_max]`` (paper: 0.001, 2.0).
        dropout: dropout on ``v`` after the transformation (default off). Uses the default RNG,
            which megatron-core keeps identical across TP ranks, so replicas stay equal.
        tp_group: the tensor-parallel group the vocabulary is split over (None: no TP).
        padded_vocab_size: the output layer's padded vocabulary (a multiple of the TP size);
            default: ``vocab_size`` rounded up to a multiple of the TP size.
        phi_init: initial pooling temperature phi (1.0 for LLMs, Appendix D.1).
        stop_grad: detach the logits (True, the paper's design); False lets tau's gradient
            flow into the LM (the ablation ``--no-tempnet-stop-grad``).

    ``W1``'s columns are split like the logits: this rank holds the columns of the true tokens in
    its slice. ``state_dict`` always holds the full ``[d1, V]`` W1 (gathered over TP, so every TP
    rank must call it), and ``load_state_dict`` slices it: checkpoints are TP-agnostic.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        hidden_size: int = 256,
        proj_size: int = 256,
        tau_min: float = 0.001,
        tau_max: float = 2.0,
        dropout: float = 0.0,
        tp_group: dist.ProcessGroup | None = None,
        padded_vocab_size: int | None = None,
        phi_init: float = 1.0,
        stop_grad: bool = True,
    ):
        super().__init__()
        check_tau_range(tau_min, tau_max)
        for name, value in (
            ("vocab_size", vocab_size),
            ("hidden_size", hidden_size),
            ("proj_size", proj_size),
        ):
            if value < 1:
                raise ValueError(f"TempNetLM {name} ({value}) must be >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"TempNetLM dropout ({dropout}) must be in [0, 1)")
        self.tp = resolve_tp_group(tp_group)
        if padded_vocab_size is None:
            padded_vocab_size = -(-vocab_size // self.tp.size) * self.tp.size
        if padded_vocab_size < vocab_size or padded_vocab_size % self.tp.size:
            raise ValueError(
                f"padded_vocab_size ({padded_vocab_size}) must be >= vocab_size ({vocab_size}) "
                f"and divisible by the tensor-parallel size ({self.tp.size})"
            )
        self.vocab_size, self.tau_min, self.tau_max = vocab_size, tau_min, tau_max
        self.partition_size = padded_vocab_size // self.tp.size
        self.part = vocab_partition(self.partition_size, self.tp.rank, vocab_size)
        self.tau_max_eval: float | None = None
        self.stop_grad = stop_grad

        self.weight1 = nn.Parameter(torch.empty(hidden_size, self.part.n_true))
        self.bias1 = nn.Parameter(torch.empty(hidden_size))
        self.weight2 = nn.Parameter(torch.empty(proj_size, hidden_size))
        self.dropout = nn.Dropout(dropout)
        self.pooling = ParameterisedPooling(proj_size, phi_init)
        # megatron-core's markers, read by its gradient clipping and checkpoint utilities.
        self.weight1.tensor_model_parallel = True
        self.weight1.partition_dim = 1
        self.weight1.partition_stride = 1
        self.reset_parameters()
        keep_float32(self)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Appendix D.1 init. The full W1 is drawn then sliced, so every TP size gives the same
        network for the same RNG state."""
        full_w1 = torch.empty(self.bias1.shape[0], self.vocab_size)
        _kaiming_uniform_(full_w1, self.vocab_size)
        self.weight1.copy_(full_w1[:, self.part.start : self.part.start + self.part.n_true])
        _kaiming_uniform_(self.bias1, self.vocab_size)
        _kaiming_uniform_(self.weight2, self.weight2.shape[1])

    def forward(
        self, vocab_parallel_logits: torch.Tensor, tau_max: float | None = None
    ) -> torch.Tensor:
        """``[b, s, V_pad/tp]`` logits (any leading shape) -> ``[b, s]`` tau in
        ``[tau_min, tau_max]``, float32 (computed in float32 from logits of any dtype).

        The logits are detached (stop-gradient): tau reaches the LM only through the loss. With
        ``stop_grad=False`` (the paper's ablation) tau's gradient also flows into the logits.
        ``tau_max`` overrides the upper bound for this call; in eval mode ``self.tau_max_eval``
        does, if set (Figure 9).
        """
        if vocab_parallel_logits.shape[-1] != self.partition_size:
            raise ValueError(
                f"TempNetLM expects {self.partition_size} logits per rank (padded vocabulary "
                f"{self.partition_size * self.tp.size} / TP {self.tp.size}), got "
                f"{vocab_parallel_logits.shape[-1]}: pass padded_vocab_size to match the output "
                f"layer"
            )
        lead = vocab_parallel_logits.shape[:-1]
        logits_2d = vocab_parallel_logits.reshape(-1, self.partition_size)[:, : self.part.n_true]
        # float32 whatever the LM's dtype (utils.precision): [T, d1]
        y = normalised_parallel_linear(logits_2d, f32(self.weight1), self.tp, self.stop_grad)
        return self.tau_from_projection(y, tau_max).view(lead)

    def tau_from_projection(
        self, y: torch.Tensor, tau_max: float | None = None, *, module_hooks: bool = True
    ) -> torch.Tensor:
        """TempNet after its transformation's product: ``y = W1 Lbar`` ``[T, d1]`` (complete
        over the vocabulary, identical on every TP rank) -> tau ``[T]``, float32.

        ``forward`` is ``normalised_parallel_linear`` then this. The fused output stage
        (``losses.output_stage``) builds ``y`` chunk by chunk and calls this with
        ``module_hooks=False``: it back-propagates each chunk inside its own forward pass, which
        the hooks of the submodules (ZeRO-3's, memory trackers') do not expect; the stage's
        module gathers TempNet's parameters itself.
        """
        dropout = self.dropout if module_hooks else self.dropout.forward
        pooling = self.pooling if module_hooks else self.pooling.forward
        v = dropout(torch.sigmoid(y + f32(self.bias1)))
        u = v @ f32(self.weight2).t()  # [T, d2]
        s = pooling(u)  # [T]
        upper = self._upper(tau_max)
        if not upper > self.tau_min:
            raise ValueError(f"tau_max ({upper}) must be > tau_min ({self.tau_min})")
        return bounded_temperature(s, self.tau_min, upper)

    def projection_parameters(self) -> list[nn.Parameter]:
        """The parameters ``tau_from_projection`` reads (all but ``weight1``)."""
        return [p for name, p in self.named_parameters() if name != "weight1"]

    def _upper(self, tau_max: float | None) -> float:
        if tau_max is not None:
            return tau_max
        if not self.training and self.tau_max_eval is not None:
            return self.tau_max_eval
        return self.tau_max

    def extra_repr(self) -> str:
        return (
            f"vocab_size={self.vocab_size}, hidden_size={self.bias1.shape[0]}, "
            f"proj_size={self.weight2.shape[0]}, tau=[{self.tau_min}, {self.tau_max}], "
            f"tp={self.tp.rank}/{self.tp.size}"
        )

    # TP-agnostic checkpoints: the full W1 is saved, and sliced on load.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight1"] = self._gather_weight1()

    def _gather_weight1(self) -> torch.Tensor:
        w1 = self.weight1.detach()
        if self.tp.size == 1 or w1.dim() != 2 or w1.shape[-1] != self.part.n_true:
            return w1  # not here whole (a ZeRO-3 partition: checkpoints save it in place)
        padded = w1.new_zeros(w1.shape[0], self.partition_size)
        padded[:, : self.part.n_true] = w1
        return self.tp.all_gather(padded, dim=1)[:, : self.vocab_size]

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "weight1"
        if key in state_dict:
            full = state_dict[key]
            expected = (self.bias1.shape[0], self.vocab_size)
            if tuple(full.shape) != expected:
                error_msgs.append(
                    f"{key}: checkpoint has shape {tuple(full.shape)}, this TempNetLM expects the "
                    f"full {expected} (hidden_size, vocab_size)"
                )
                return
            state_dict = dict(state_dict)
            state_dict[key] = full[:, self.part.start : self.part.start + self.part.n_true]
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
