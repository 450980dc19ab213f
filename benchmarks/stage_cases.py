"""loss_bench.py's "stage" section: the whole output stage, forward + backward, float32.

Cases (final hidden states ``[T, h]`` and this rank's output weight ``[V/tp, h]`` in, gradients
of both and of TempNet out):

  u    the unfused stage: output GEMM, then ``token_losses_from_logits`` (TempNet, DRO, the
       reported cross-entropy), the path of ``--no-fused-output-stage``
  f    the fused output stage: ``token_losses_fused`` on ``FinalHidden`` (the default)
  f-r  the fused stage with its gradients recomputed in the backward pass
       (``eager_gradients=False``)
  a    megatron-core's output layer GEMM + ``vocab_parallel_cross_entropy``
  u-ce the unfused stage with ``--loss ce``
  f-ce the fused stage with ``--loss ce``
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)

from megatron_tempnet.losses import TempNetTau, fused_output_stage
from megatron_tempnet.models.gpt.layers import FinalHidden
from megatron_tempnet.models.gpt.objective import (
    LossConfig,
    token_losses_from_logits,
    token_losses_fused,
)
from megatron_tempnet.tempnet import TempNetLM

STAGE_CASES = ["u", "f", "f-r", "a", "u-ce", "f-ce"]
STAGE_NAMES = {
    "u": "unfused: GEMM + TempNet + DRO",
    "f": "fused: TempNet + DRO",
    "f-r": "recompute: TempNet + DRO",
    "a": "megatron-core GEMM + CE",
    "u-ce": "unfused: GEMM + CE (--loss ce)",
    "f-ce": "fused: CE (--loss ce)",
}
STAGE_SHAPES = ["768:50304:1", "768:50304:2", "4096:32000:1"]
"""hidden:padded vocabulary:TP, the shapes of the issue's table."""


def setup_stage(device, tokens: int, hidden: int, vocab: int, tp: int, rank: int):
    """``make_step(case)`` -> (reset, inputs, step) for ``loss_bench._measure_cases``."""
    gen = torch.Generator().manual_seed(0)
    shard = vocab // tp
    h = torch.randn(tokens, 1, hidden, generator=gen).to(device).requires_grad_()  # [s, b, h]
    w_full = torch.randn(vocab, hidden, generator=gen) * (3.0 / hidden**0.5)
    w = w_full[rank * shard : (rank + 1) * shard].contiguous().to(device).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=gen).to(device)  # [b, s]
    group = parallel_state.get_tensor_model_parallel_group()
    tempnet = TempNetLM(vocab, tp_group=group).to(device)
    params = [h, w, *tempnet.parameters()]
    configs = {
        "dro": LossConfig(loss="dro", tau_source="tempnet", rho=10.0),
        "ce": LossConfig(loss="ce", tau_source="fixed"),
    }

    def logits():  # [b, s, V/tp], as the output layer returns them
        return F.linear(copy_to_tensor_model_parallel_region(h), w).transpose(0, 1)

    def loss(case):
        config = configs["ce" if case.endswith("ce") else "dro"]
        common = dict(vocab_size=vocab, tempnet=tempnet, tp_group=group)
        if case == "a":
            return vocab_parallel_cross_entropy(logits().contiguous(), labels).mean()
        if case.startswith("u"):
            return token_losses_from_logits(logits(), labels, config, **common).loss.mean()
        if case == "f-r":  # what token_losses_fused does, without the eager gradients
            out = fused_output_stage(
                h, w, labels.t(), loss="dro", rho=config.rho, eager_gradients=False,
                vocab_size=vocab, tau=TempNetTau(tempnet), tp_group=group,
            )  # fmt: skip
            return out.loss.mean()
        return token_losses_fused(FinalHidden(h, w), labels, config, **common).loss.mean()

    def make_step(case):
        def reset():  # last step's gradients are not part of this step's memory
            for p in params:
                p.grad = None

        def step(_):
            loss(case).backward()

        return reset, lambda: None, step

    return make_step


def stage_targets(rows):
    """(description, value, limit, passed) for the issue's targets."""
    idx = {(r["tp"], r["hidden"], r["case"]): r for r in rows}
    checks = []
    for (tp, h, case), r in sorted(idx.items()):
        if case not in ("f", "f-ce"):
            continue
        base = idx.get((tp, h, "u" if case == "f" else "u-ce"))
        label = f"tp={tp} h={h} V/tp={r['shard']}: ({case})/({base['case']})"
        checks.append((f"{label} peak", r["peak_mb"] / base["peak_mb"], 0.25))
        if r["time_ms"] is not None and base["time_ms"] is not None:
            checks.append((f"{label} time", r["time_ms"] / base["time_ms"], 1.15))
            if case == "f-ce" and (tp, h, "a") in idx:
                a = idx[(tp, h, "a")]
                checks.append(
                    (f"tp={tp} h={h}: (f-ce)/(a) time", r["time_ms"] / a["time_ms"], 1.15)
                )
                checks.append(
                    (f"tp={tp} h={h}: (f-ce)/(a) peak", r["peak_mb"] / a["peak_mb"], 0.25)
                )
    return [(d, v, lim, v <= lim) for d, v, lim in checks]
