"""How gradients are accumulated and reduced, and which communication overlaps the computation:
Megatron-LM's flags as DeepSpeed config entries, at the run's ZeRO stage and layout.

- ``--overlap-grad-reduce``: ``zero_optimization.overlap_comm`` (ZeRO 1-3 reduce the gradients
  in buckets on a side stream while the backward pass goes on). At ZeRO 0 DeepSpeed all-reduces
  after the backward pass, and its pipeline engine turns the overlap off.
- ``--overlap-param-gather``: ZeRO-3's parameter prefetch (``stage3_prefetch_bucket_size``: the
  next layers' shards are gathered while the current ones compute). ZeRO 1-2 gather the updated
  parameters inside the optimizer step, with nothing to overlap.
- Gradient precision under ``--bf16``: float32 by default (``data_types.grad_accum_dtype`` and
  ``communication_data_type`` fp32: the micro-batches' gradients are summed in float32 buffers
  and all-reduced or reduce-scattered in float32); ``--grad-reduce-in-bf16``: both bfloat16.
  DeepSpeed sums in float32 with its bf16 optimizer (ZeRO 1) or its ZeRO 2-3 partitions, which is
  why ``validate_run`` runs a ``--bf16`` run of ``--zero-stage 0`` at ZeRO 1.
- The bf16 optimizer's ``bf16.immediate_grad_update`` is on (``bf16_section``): it adds
  each bfloat16 gradient to the float32 sum as autograd produces it. Its delayed update adds all
  of them after every backward pass, and relies on a hook that clears them before the next one.
  That hook sits on the tensors the module returns; the tasks return a dataclass, where DeepSpeed
  finds none, so micro-batch k of N would count N - k + 1 times.

Without the overlap flags both overlaps are off, Megatron-LM's default, unless a
``--deepspeed-config`` file turns them on.
"""

from __future__ import annotations

from megatron_tempnet.trainer.config import ConfigError, RunConfig

PREFETCH = "stage3_prefetch_bucket_size"
"""ZeRO-3's prefetch key (DeepSpeed also reads it as ``prefetch_bucket_size``)."""
DEEPSPEED_PREFETCH = 50_000_000
"""DeepSpeed's default prefetch bucket (elements), used when --overlap-param-gather turns the
prefetch on and the --deepspeed-config file gives none."""


def zero_overlap(config: RunConfig, zero: dict) -> dict:
    """``zero_optimization`` with the overlap entries of the flags; ``zero``: the section as the
    --deepspeed-config file gives it (its values stand where no flag is given)."""
    p = config.parallel
    out = dict(zero)
    out["overlap_comm"] = bool(p.overlap_grad_reduce or zero.get("overlap_comm", False))
    if p.zero_stage == 3:
        given = out.pop("prefetch_bucket_size", out.pop(PREFETCH, None))
        if p.overlap_param_gather:
            out[PREFETCH] = int(given) if given else DEEPSPEED_PREFETCH
        else:
            out[PREFETCH] = int(given) if given is not None else 0
    return out


def gradient_dtype(config: RunConfig) -> str | None:
    """``fp32`` or ``bf16``: DeepSpeed's gradient accumulation and reduction dtype under --bf16
    (None: the training dtype's, in float32 and fp16 runs)."""
    t = config.training
    if not t.bf16:
        return None
    return "bf16" if t.grad_reduce_in_bf16 else "fp32"


def precision_entries(config: RunConfig) -> dict:
    """The DeepSpeed config entries of the gradients' dtype (empty outside --bf16)."""
    dtype = gradient_dtype(config)
    if dtype is None:
        return {}
    return {"data_types": {"grad_accum_dtype": dtype}, "communication_data_type": dtype}


def bf16_section(config: RunConfig, given: dict, accumulation_steps: int) -> dict | None:
    """DeepSpeed's ``bf16`` section: the --deepspeed-config file's (``given``: its whole JSON,
    the section under ``bf16`` or its older name ``bfloat16``), enabled by --bf16, with
    ``immediate_grad_update`` on unless the file turns it off (see the module docstring); that
    is refused when an iteration accumulates micro-batches (``accumulation_steps`` > 1). None
    when neither the flag nor the file enables bfloat16."""
    section = dict(given.get("bf16", given.get("bfloat16", {})))
    if config.training.bf16:
        section["enabled"] = True
    if not section.get("enabled", False):
        return None
    if section.get("immediate_grad_update", True) is False and accumulation_steps > 1:
        raise ConfigError(
            f"--deepspeed-config {config.parallel.deepspeed_config}: bf16.immediate_grad_update "
            f"false counts each of the {accumulation_steps} micro-batches accumulated per "
            "iteration again after every later one: remove the entry or set it true"
        )
    section.setdefault("immediate_grad_update", True)
    return section


def describe(config: RunConfig, ds_config: dict) -> dict[str, str]:
    """What --overlap-grad-reduce, --overlap-param-gather and --grad-reduce-in-bf16 map to in
    this run (its ZeRO stage, pipeline, precision, and ``ds_config``: the engine's DeepSpeed
    config), one phrase per flag, for the start-up lines."""
    p = config.parallel
    stage, zero = p.zero_stage, ds_config.get("zero_optimization", {})
    on = "on" if zero.get("overlap_comm") else "off"
    if stage == 0:
        grads = "no effect at ZeRO 0: DeepSpeed all-reduces the gradients after the backward pass"
    elif p.pipeline_model_parallel_size > 1:
        grads = "no effect with pipeline parallelism: DeepSpeed's pipeline engine reduces after it"
    else:
        grads = f"DeepSpeed zero_optimization.overlap_comm {on} (ZeRO {stage})"
    if stage == 3:
        params = f"ZeRO-3 parameter prefetch, {PREFETCH} {zero.get(PREFETCH)}"
    else:
        params = (
            f"no effect at ZeRO {stage}: DeepSpeed's optimizer step gathers the updated "
            "parameters itself"
        )
    return {
        "--overlap-grad-reduce": grads,
        "--overlap-param-gather": params,
        "--grad-reduce-in-bf16": _describe_dtype(config),
    }


def _describe_dtype(config: RunConfig) -> str:
    dtype = gradient_dtype(config)
    if dtype is None:
        return "no effect without --bf16: the gradients have the training dtype"
    stage = config.parallel.zero_stage
    entries = f"DeepSpeed data_types.grad_accum_dtype and communication_data_type {dtype}"
    if dtype == "bf16":
        return f"gradients accumulated and reduced in bfloat16 ({entries})"
    where = "DeepSpeed's bf16 optimizer" if stage == 1 else f"ZeRO {stage}'s gradient partitions"
    return f"gradients accumulated and reduced in float32 ({entries}; {where})"
