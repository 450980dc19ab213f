"""Pipeline stages as the trainer runs them: DeepSpeed's ``PipelineModule`` with three additions.

- **Optional last piece.** A weights-only load (--finetune, --pretrained-checkpoint) may find no
  layer file for the stage's last piece when all its parameters are under an ``optional`` prefix
  (TempNet on an LM-only checkpoint); that piece keeps its initialisation.
- **Forward-only stages.** With ``forward_only`` (a frozen model before a trained last piece) the
  activations a stage receives are detached, and the engine runs backward on the last stage only
  (``compat.last_stage_backward_engine``).
- **Matching parameter groups.** DeepSpeed reduces the gradient norm over all stages once per
  optimizer group, so every stage needs every group: ``group_placeholder`` gives a stage that has
  no parameter of a group a zero one. It gets no gradient, except on a frozen stage under
  DeepSpeed's bf16 optimizer, where a zero one lets that stage take part in the norm and the
  step (``compat.last_stage_backward_engine``).
"""

from __future__ import annotations

import torch
from deepspeed.pipe import PipelineModule
from torch import nn

from megatron_tempnet.trainer.step import clip_grad_norm_, compute_device


class Pipeline(PipelineModule):
    """``PipelineModule(layers, ...)`` plus ``optional`` ({state-dict prefix: what it is}) and
    ``forward_only``.

    ``name_prefix`` and ``tied_pieces`` (subclasses) map the stage's parameters to the names they
    have in the one-process model (``layout_free_parameters``): piece ``i``'s ``x`` is
    ``{name_prefix}{i}.x`` (an optional piece's keeps its own name), a tied module's is that of
    the piece ``tied_pieces[key]``.
    """

    name_prefix = ""
    tied_pieces: dict[str, int] = {}

    def __init__(
        self, *args, optional: dict[str, str] | None = None, forward_only: bool = False, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.optional = dict(optional or {})
        self.forward_only = forward_only

    def forward(self, forward_input):
        if self.forward_only:  # a received activation asks for gradients that nobody will use
            forward_input = _detached(forward_input)
        return super().forward(forward_input)

    def layout_free_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This stage's parameters under their one-process names (placeholders left out)."""
        named = []
        for name, param in self.named_parameters():
            head, _, rest = name.partition(".")
            if head == "tied_modules":
                key, _, rest = rest.partition(".")
                named.append((f"{self.name_prefix}{self.tied_pieces[key]}.{rest}", param))
            elif head.isdigit():
                optional = any(rest.startswith(prefix) for prefix in self.optional)
                named.append((rest if optional else f"{self.name_prefix}{head}.{rest}", param))
        return named

    def group_placeholder(self, name: str) -> nn.Parameter:
        """A registered zero parameter standing in for group ``name`` on this stage."""
        device = next(self.parameters()).device
        placeholder = nn.Parameter(torch.zeros(1, device=device))
        self.register_parameter(f"{name}_group_placeholder", placeholder)
        return placeholder


def _detached(x):
    if isinstance(x, tuple):
        return tuple(t.detach() if torch.is_tensor(t) else t for t in x)
    return x.detach()


class NormRecorder:
    """Clips before every optimizer step (ZeRO 0, float32, where DeepSpeed's pipeline clipping
    would count replicated parameters on the first stage only) and keeps the norm."""

    def __init__(self, optimizer, max_norm: float):
        self.max_norm, self.norm = max_norm, None
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        optimizer.register_step_pre_hook(self._hook)

    def _hook(self, optimizer, args, kwargs):
        self.norm = clip_grad_norm_(self._params, self.max_norm)


def train_through_schedule(engine, micro_batches, stats, *, dp_group, pp_group, norm):
    """One iteration of DeepSpeed's pipeline schedule over ``micro_batches``, then the step's
    statistics: ``stats`` (the objective's, filled by the last stage during the schedule)
    reduced over the data-parallel ranks and the stages, with the tau sample shared from the
    last stage. ``norm``: the ``NormRecorder`` that clipped, or None (DeepSpeed's norm)."""
    engine.train_batch(micro_batches)
    grad_norm = norm.norm if norm is not None else engine.get_global_grad_norm()
    reduced = stats.reduce(
        dp_group, pp_group, grad_norm=grad_norm, applied=engine.was_step_applied()
    )
    sample = reduced.tau_sample
    reduced.tau_sample = lambda: share_from_last_stage(sample(), pp_group)
    return reduced


def share_from_last_stage(sample: torch.Tensor, pp_group) -> torch.Tensor:
    """The tau sample of the one stage that has it, on every stage of ``pp_group``."""
    count = torch.tensor([sample.numel()], dtype=torch.float64, device=compute_device())
    torch.distributed.all_reduce(count, group=pp_group)
    buffer = torch.zeros(int(count.item()), dtype=torch.float64, device=compute_device())
    if sample.numel():
        buffer.copy_(sample.to(buffer))
    torch.distributed.all_reduce(buffer, group=pp_group)
    return buffer.float().cpu()
