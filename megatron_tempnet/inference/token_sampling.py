"""Choosing the next token from vocabulary-parallel logits, without gathering the vocabulary.

Each TP rank holds ``[b, V_pad/tp]`` logits of the last position. Temperature scaling is
``L / tau`` per sequence. The choices need only small collectives:

- greedy: a MAX all-reduce of the best value, then a MIN all-reduce of the best global index
  (ties go to the lowest id, as ``argmax`` does);
- top-k: each rank's k best values are all-gathered (``[b, k * tp]``); tokens below the global
  k-th value are dropped (ties at the threshold are kept);
- top-p (nucleus): the kept set is the tokens whose probability ``p_i`` satisfies
  ``sum_j p_j [p_j > p_i] < top_p``, i.e. ``p_i >= t*`` for one threshold, found by bisection on
  the bits of a float32 threshold (31 SUM all-reduces of ``[b]``; exact);
- sampling: the Gumbel-max trick, ``argmax_i (L_i / tau + g_i)`` over the kept tokens, a sample of
  ``softmax(L / tau)`` restricted to them. The noise ``g`` is drawn for the whole true vocabulary
  on every rank and each rank takes its columns, so the sample does not depend on the TP size.
  Every sequence draws from its own generator, seeded from the seed and the sequence's stream
  number (its prompt's index): a sample does not depend on which prompts share its batch. The
  generators live on the logits' device, so the noise is drawn there (a CUDA generator draws
  other numbers than a CPU one: a seed gives the same samples on every GPU layout, and other
  samples on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tempnet.distributed.groups import TPGroup, parallel_argmax, vocab_partition
from megatron_tempnet.inference.model import InferenceError

_MAX = torch.distributed.ReduceOp.MAX


@dataclass
class SamplingConfig:
    """How the next token is chosen."""

    greedy: bool = True
    """Take the most likely token (tau and the filters do not change it)."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens with probability mass >= top_p."""
    seed: int = 1234
    """Seed of the sampling noise."""

    def validate(self) -> None:
        if self.top_k < 0:
            raise InferenceError(f"--top-k ({self.top_k}) must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise InferenceError(f"--top-p ({self.top_p}) must be in (0, 1]")


class TokenChooser:
    """``choose(logits [b, V_pad/tp], tau [b]) -> token ids [b]`` (identical on every rank)."""

    def __init__(self, config: SamplingConfig, vocab_size: int, tp: TPGroup, partition: int):
        config.validate()
        self.config, self.tp, self.vocab_size = config, tp, vocab_size
        self.part = vocab_partition(partition, tp.rank, vocab_size)
        self._generators: dict[int, torch.Generator] = {}

    def generator(self, stream: int, device: torch.device) -> torch.Generator:
        """The noise generator of sequence ``stream`` on ``device`` (made at its first draw)."""
        if stream not in self._generators:
            seed = (self.config.seed * 0x9E3779B1 + stream) % (1 << 63)
            self._generators[stream] = torch.Generator(device=device).manual_seed(seed)
        return self._generators[stream]

    def choose(
        self, logits: torch.Tensor, tau: torch.Tensor, streams: list[int] | None = None
    ) -> torch.Tensor:
        """The next token of each row; row ``i`` samples with generator ``streams[i]``
        (default: its row number)."""
        local = logits[:, : self.part.n_true].float() / tau[:, None]  # [b, n_true]
        if self.config.greedy:
            return self._argmax(local)
        if self.config.top_k:
            local = self._top_k(local, self.config.top_k)
        if self.config.top_p < 1.0:
            local = self._top_p(local, self.config.top_p)
        streams = range(local.shape[0]) if streams is None else streams
        device = local.device
        u = torch.stack(
            [
                torch.rand(
                    self.vocab_size,
                    generator=self.generator(i, device),
                    dtype=torch.float64,
                    device=device,
                )
                for i in streams
            ]
        )
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        noise = gumbel[:, self.part.start : self.part.start + self.part.n_true]
        return self._argmax(local.double() + noise)

    def _argmax(self, local: torch.Tensor) -> torch.Tensor:
        return parallel_argmax(local, self.part.start, self.tp)

    def _top_k(self, local: torch.Tensor, k: int) -> torch.Tensor:
        take = min(k, local.shape[-1])
        mine = local.new_full((local.shape[0], k), float("-inf"))
        if take:
            mine[:, :take] = local.topk(take, dim=-1).values
        everyone = self.tp.all_gather(mine, dim=1)  # [b, k * tp]
        kth = everyone.topk(min(k, everyone.shape[-1]), dim=-1).values[:, -1:]
        return local.masked_fill(local < kth, float("-inf"))

    def _top_p(self, local: torch.Tensor, top_p: float) -> torch.Tensor:
        top = (
            local.max(dim=-1).values
            if local.shape[-1]
            else local.new_full((local.shape[0],), float("-inf"))
        )
        self.tp.all_reduce(top, _MAX)
        weights = torch.exp(local.double() - top[:, None].double())  # exp(-inf) = 0
        total = weights.sum(-1)
        self.tp.all_reduce(total)
        probs = (weights / total[:, None]).float()  # [b, n_true]
        # smallest float32 t (as bits; non-negative floats order like their bits) with
        # mass(p > t) < top_p: the kept tokens are those with p >= t
        lo = torch.zeros(local.shape[0], dtype=torch.int64, device=local.device)
        hi = torch.full_like(lo, 0x3F800000)  # 1.0: mass(p > 1) = 0 < top_p
        for _ in range(31):
            mid = (lo + hi) // 2
            t = mid.to(torch.int32).view(torch.float32)
            mass = (probs.double() * (probs > t[:, None])).sum(-1)
            self.tp.all_reduce(mass)
            below = mass < top_p
            hi = torch.where(below, mid, hi)
            lo = torch.where(below, lo, mid)
        threshold = hi.to(torch.int32).view(torch.float32)
        return local.masked_fill(probs < threshold[:, None], float("-inf"))
