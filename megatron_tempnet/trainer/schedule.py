"""The run's schedules, counted in samples as Megatron-LM counts them: the global batch of each
iteration (``--rampup-batch-size``) and the learning rate (``--lr-decay-style`` and the warm-up).

**Batch.** Without a ramp every iteration takes ``--global-batch-size`` samples. With
``--rampup-batch-size START INCREMENT SAMPLES`` the iteration that starts after ``c`` consumed
samples takes ``START + INCREMENT x int(c / (SAMPLES / n))`` samples, ``n = (global - START) /
INCREMENT`` increments, and the full global batch once ``c > SAMPLES``; the micro-batch size
stays and the number of micro-batches per iteration follows. ``--train-samples`` makes
``iterations``: the ramp's iterations while ``c <= SAMPLES`` (and ``c <= --train-samples``), then
whole global batches of what is left (a last partial batch is dropped); with ``--train-iters``
the run takes that many iterations, whatever their batches.

**Learning rate.** ``s`` is the number of samples the optimizer has stepped on before this
iteration (an fp16 step skipped for overflow does not count). With ``W`` warm-up and ``D`` decay
samples (``--lr-*-iters`` x the global batch with --train-iters, the ``--lr-*-samples``
themselves with --train-samples, or ``W = --lr-warmup-fraction x D``):

- ``s <= W`` (when ``W > 0``): ``init + (peak - init) s / W`` (init: --lr-warmup-init);
- constant: ``peak``; otherwise past the decay (``s > D``): ``floor`` (--min-lr);
- inverse-square-root: ``max(floor, peak sqrt(max(W, 1)) / sqrt(max(s, 1)))``;
- otherwise ``floor + (peak - floor) k`` with ``r = (s - W) / (D - W)`` and ``k = 1 - r``
  (linear), ``(1 + cos(pi r)) / 2`` (cosine), or for WSD 1 until the last ``E`` samples of the
  decay (--lr-wsd-decay-*), then with ``q`` their elapsed fraction ``2 x 0.5^q - 1``
  (exponential), ``1 - q``, ``(1 + cos(pi q)) / 2`` or ``1 - sqrt(q)`` (minus_sqrt).

Each optimizer group has its own peak and floor (TempNet's --tempnet-lr); all share the shape,
except a group kept at its peak throughout (TempNet's with --tempnet-constant-lr).
``validate_schedule`` checks the flags as Megatron-LM asserts them (one unit per run: iterations
or samples), with errors that name them.

**Resume.** Every checkpoint records the schedule (``settings``: the shape and each group's peak,
floor and weight decay). A resume whose flags give another one stops, naming the first
difference, unless --use-checkpoint-opt-param-scheduler takes the checkpoint's or
--override-opt-param-scheduler keeps the run's (``resumed_settings``, Megatron-LM's rule).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from megatron_tempnet.trainer.errors import ConfigError
from megatron_tempnet.utils.logging import log_rank0


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch of every iteration; ``rampup``: ``(start, increment, samples)``."""

    global_batch_size: int
    rampup: tuple[int, int, int] | None = None

    def batch_size(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples``."""
        if self.rampup is None:
            return self.global_batch_size
        start, increment, samples = self.rampup
        if consumed_samples > samples:
            return self.global_batch_size
        per_increment = samples / ((self.global_batch_size - start) // increment)
        return start + int(consumed_samples / per_increment) * increment

    @functools.cache  # noqa: B019  (a frozen value; the loop asks every iteration)
    def iterations(self, train_samples: int) -> int:
        """The iterations ``--train-samples`` makes (Megatron-LM's count)."""
        if self.rampup is None:
            return train_samples // self.global_batch_size
        iterations = consumed = 0
        while consumed <= self.rampup[2] and consumed <= train_samples:
            consumed += self.batch_size(consumed)
            iterations += 1
        return iterations + max(train_samples - consumed, 0) // self.global_batch_size

    def consumed(self, iterations: int) -> int:
        """The samples the first ``iterations`` iterations take."""
        done = samples = 0
        while done < iterations and self.batch_size(samples) != self.global_batch_size:
            samples += self.batch_size(samples)
            done += 1
        return samples + (iterations - done) * self.global_batch_size


@dataclass(frozen=True)
class LRSchedule:
    """Megatron-LM's learning-rate schedule over samples (module docstring)."""

    style: str
    warmup: float
    """``W``: warm-up samples (fractional with --lr-warmup-fraction)."""
    decay: int
    """``D``: samples until the decay ends, warm-up included."""
    init_lr: float = 0.0
    wsd_style: str = "exponential"
    wsd_decay: int | None = None
    """``E``: WSD's final decay, in samples."""

    @classmethod
    def from_config(cls, opt, training) -> LRSchedule:
        """From an ``OptimizerConfig`` and a validated ``TrainingConfig`` (its unit decides
        which flags count)."""
        if training.train_samples is None:
            batch = training.global_batch_size
            decay = opt.lr_decay_iters * batch
            wsd = None if opt.lr_wsd_decay_iters is None else opt.lr_wsd_decay_iters * batch
            warmup = opt.lr_warmup_iters * batch
        else:
            decay, wsd, warmup = (
                opt.lr_decay_samples,
                opt.lr_wsd_decay_samples,
                opt.lr_warmup_samples,
            )
        if opt.lr_warmup_fraction is not None:
            warmup = opt.lr_warmup_fraction * decay
        return cls(
            opt.lr_decay_style, warmup, decay, opt.lr_warmup_init, opt.lr_wsd_decay_style, wsd
        )

    def lr(self, samples: int, peak: float, floor: float) -> float:
        """The learning rate after ``samples`` stepped samples, for a group of ``peak`` and
        ``floor``."""
        if self.warmup > 0 and samples <= self.warmup:
            return self.init_lr + (peak - self.init_lr) * samples / self.warmup
        if self.style == "constant":
            return peak
        if samples > self.decay:
            return floor
        if self.style == "inverse-square-root":
            return max(floor, peak * max(self.warmup, 1) ** 0.5 / max(samples, 1) ** 0.5)
        return floor + (peak - floor) * self._coefficient(samples)

    def _coefficient(self, samples: int) -> float:
        """``k`` in [0, 1] of the linear, cosine and WSD styles."""
        ratio = (samples - self.warmup) / (self.decay - self.warmup)
        if self.style == "linear":
            return 1.0 - ratio
        if self.style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        stable = self.decay - self.wsd_decay  # WSD: the stable phase ends here
        if samples <= stable:
            return 1.0
        q = (samples - stable) / self.wsd_decay
        return {
            "exponential": lambda: 2.0 * 0.5**q - 1.0,
            "linear": lambda: 1.0 - q,
            "cosine": lambda: 0.5 * (math.cos(math.pi * q) + 1.0),
            "minus_sqrt": lambda: 1.0 - math.sqrt(q),
        }[self.wsd_style]()


LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


def validate_schedule(o, t, dp: int) -> None:
    """The checks of the run's length, batch ramp and learning-rate flags (an
    ``OptimizerConfig`` and a ``TrainingConfig`` whose global batch is filled, ``dp``
    data-parallel ranks); fills the decay length (--lr-decay-iters or --lr-decay-samples)."""
    validate_rampup(t, dp)
    _validate_length(o, t)
    _validate_lr(o, t)
    if o.override_opt_param_scheduler and o.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler choose "
            "opposite schedules on resume: give one"
        )


def validate_rampup(t, dp: int) -> None:
    """--rampup-batch-size START INCREMENT SAMPLES: every batch of the ramp must be whole
    micro-batches on every data-parallel rank."""
    if t.rampup_batch_size is None:
        return
    ramp = tuple(t.rampup_batch_size)
    flag = f"--rampup-batch-size {' '.join(map(str, ramp))}"
    if len(ramp) != 3:
        raise ConfigError(f"{flag}: give three numbers, START INCREMENT SAMPLES")
    start, increment, samples = ramp
    if min(start, increment, samples) < 1:
        raise ConfigError(f"{flag}: START, INCREMENT and SAMPLES must be >= 1")
    gbs = t.global_batch_size
    if start >= gbs or (gbs - start) % increment:
        raise ConfigError(
            f"{flag}: START must be below --global-batch-size ({gbs}) and reach it in steps of "
            "INCREMENT"
        )
    step = t.micro_batch_size * dp
    uneven = [b for b in range(start, gbs, increment) if b % step]
    if uneven:
        raise ConfigError(
            f"{flag}: the batch of {uneven[0]} samples is not a multiple of --micro-batch-size "
            f"({t.micro_batch_size}) x data-parallel size ({dp}), as every batch of the ramp "
            "must be"
        )


def _validate_length(o, t) -> None:
    """--train-iters or --train-samples, and only the schedule flags of the same unit
    (Megatron-LM's rule); fills the decay length. A batch ramp goes with either (Megatron-LM
    asserts that it goes with --train-samples only, which stops its own GPT-3 175B example; the
    iteration-based schedule counts --lr-*-iters x --global-batch-size samples either way)."""
    iters = {
        "--train-iters": t.train_iters,
        "--lr-decay-iters": o.lr_decay_iters,
        "--lr-warmup-iters": o.lr_warmup_iters or None,
        "--lr-wsd-decay-iters": o.lr_wsd_decay_iters,
    }
    samples = {
        "--train-samples": t.train_samples,
        "--lr-decay-samples": o.lr_decay_samples,
        "--lr-warmup-samples": o.lr_warmup_samples or None,
        "--lr-wsd-decay-samples": o.lr_wsd_decay_samples,
    }
    if (t.train_iters is None) == (t.train_samples is None):
        raise ConfigError("give the run's length: one of --train-iters and --train-samples")
    unit, given, other = ("iterations", iters, samples)
    if t.train_samples is not None:
        unit, given, other = ("samples", samples, iters)
    mixed = [flag for flag, value in other.items() if value is not None]
    if mixed:
        raise ConfigError(
            f"{list(given)[0]} counts the run in {unit}: {', '.join(mixed)} cannot be used with "
            f"it (use {', '.join(given)})"
        )
    for flag, value in given.items():
        if value is not None and value < 1:
            raise ConfigError(f"{flag} ({value}) must be >= 1")
    if t.train_samples is None:
        o.lr_decay_iters = t.train_iters if o.lr_decay_iters is None else o.lr_decay_iters
    else:
        o.lr_decay_samples = t.train_samples if o.lr_decay_samples is None else o.lr_decay_samples
    if t.iterations < 1:
        raise ConfigError(
            f"--train-samples ({t.train_samples}) is less than one global batch "
            f"({t.global_batch_size})"
        )


def _validate_lr(o, t) -> None:
    """What Megatron-LM's scheduler asserts, as errors naming the flags."""
    if o.lr is None:
        raise ConfigError("--lr is required: the peak learning rate (Megatron-LM has no default)")
    if o.lr_warmup_fraction is not None and (o.lr_warmup_iters or o.lr_warmup_samples):
        raise ConfigError(
            "give one of --lr-warmup-fraction and --lr-warmup-iters / --lr-warmup-samples"
        )
    if o.lr_warmup_fraction is not None and not 0 <= o.lr_warmup_fraction < 1:
        raise ConfigError(f"--lr-warmup-fraction ({o.lr_warmup_fraction}) must be in [0, 1)")
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"--min-lr ({o.min_lr}) must be in [0, --lr ({o.lr})]")
    if not o.lr_warmup_init <= o.lr:
        raise ConfigError(f"--lr-warmup-init ({o.lr_warmup_init}) must be <= --lr ({o.lr})")
    if o.lr_decay_style not in LR_DECAY_STYLES:
        raise ConfigError(
            f"--lr-decay-style {o.lr_decay_style!r}: expected one of {', '.join(LR_DECAY_STYLES)}"
        )
    if o.lr_wsd_decay_style not in WSD_DECAY_STYLES:
        raise ConfigError(
            f"--lr-wsd-decay-style {o.lr_wsd_decay_style!r}: expected one of "
            + ", ".join(WSD_DECAY_STYLES)
        )
    schedule = LRSchedule.from_config(o, t)
    unit = "iters" if t.train_samples is None else "samples"
    if o.lr_decay_style == "WSD" and schedule.wsd_decay is None:
        raise ConfigError(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}: its final decay")
    if schedule.warmup >= schedule.decay:
        decay = f"--lr-decay-samples {o.lr_decay_samples}"
        if t.train_samples is None:
            decay = f"--lr-decay-iters {o.lr_decay_iters} x {t.global_batch_size} samples"
        raise ConfigError(
            f"the warm-up ({schedule.warmup:g} samples) must end before the decay does ({decay})"
        )


class TrainSchedule:
    """Where a run is in its schedules: the global batch of each iteration and the learning
    rates, from the samples consumed and the samples the optimizer stepped on (they differ
    only after fp16 steps skipped for overflow; Megatron-LM's scheduler does not count those).
    ``state_dict`` goes into every checkpoint."""

    def __init__(self, batches: BatchSchedule, lr: LRSchedule, stepped_samples: int = 0):
        self.batches, self.lr = batches, lr
        self.stepped_samples = stepped_samples
        self.batch: int | None = None

    def begin(self, iteration: int, consumed_samples: int) -> int:
        """Iteration ``iteration`` (1-based) starts after ``consumed_samples``: its global
        batch (logged when the ramp changes it)."""
        batch = self.batches.batch_size(consumed_samples)
        if self.batch is not None and batch != self.batch:
            log_rank0("iteration %d: the global batch ramps up from %d to %d", iteration,
                      self.batch, batch)  # fmt: skip
        self.batch = batch
        return batch

    def set_learning_rates(self, optimizer) -> dict[str, float]:
        """Set every group's lr for the coming iteration; returns one lr per schedule: the first
        group's as ``lr``, every other one's as ``{schedule}_lr`` (``tempnet_lr``)."""
        rates: dict[str, float] = {}
        first = None
        for group in optimizer.param_groups:
            if group.get("constant_lr"):  # --tempnet-constant-lr
                group["lr"] = group["max_lr"]
            else:
                group["lr"] = self.lr.lr(self.stepped_samples, group["max_lr"], group["min_lr"])
            # checkpoints written before groups had a schedule name them by the group
            name = group.get("schedule") or group.get("name", "").removesuffix("_no_decay")
            first = first or name
            rates.setdefault("lr" if name == first else f"{name}_lr", group["lr"])
        return rates

    def end(self, applied: bool) -> None:
        """The iteration begun last is done; ``applied``: the optimizer stepped."""
        if applied:
            self.stepped_samples += self.batch

    def state_dict(self, optimizer=None) -> dict:
        """The position; with ``optimizer``, the ``settings`` a resume compares."""
        state = {"stepped_samples": self.stepped_samples}
        if optimizer is not None:
            state["settings"] = settings(self.lr, optimizer)
        return state

    def load_state_dict(self, state: dict | None, consumed_samples: int) -> None:
        """From a checkpoint; one saved before the schedule was recorded stepped on every
        sample it consumed."""
        self.stepped_samples = int((state or {}).get("stepped_samples", consumed_samples))


_GROUP_VALUES = ("max_lr", "min_lr", "weight_decay")


def settings(lr: LRSchedule, optimizer) -> dict:
    """What a resume compares: the schedule's shape, and each group's peak, floor and weight
    decay (by the group's name)."""
    groups = {
        g.get("name", str(i)): {k: g[k] for k in _GROUP_VALUES}
        for i, g in enumerate(optimizer.param_groups)
    }
    return {"lr_schedule": dataclasses.asdict(lr), "groups": groups}


_SHAPE_NAMES = {
    "style": "--lr-decay-style",
    "warmup": "warm-up samples",
    "decay": "decay samples (--lr-decay-iters or --train-iters x the global batch, or "
    "--lr-decay-samples)",
    "init_lr": "--lr-warmup-init",
    "wsd_style": "--lr-wsd-decay-style",
    "wsd_decay": "WSD decay samples",
}


def _differences(saved: dict, mine: dict) -> list[str]:
    out = []
    for key, value in mine["lr_schedule"].items():
        if key in saved["lr_schedule"] and saved["lr_schedule"][key] != value:
            name = _SHAPE_NAMES.get(key, key)
            out.append(f"{name} {saved['lr_schedule'][key]} (this run: {value})")
    for name, values in mine["groups"].items():
        for key, value in values.items():
            theirs = saved["groups"].get(name, {}).get(key, value)
            if theirs != value:
                out.append(f"the {name} group's {key} {theirs} (this run: {value})")
    return out


def resumed_settings(
    schedule: TrainSchedule, optimizer, saved: dict | None, opt, source: str
) -> None:
    """Megatron-LM's rule for the schedule of a resume: the checkpoint's ``saved`` settings
    and the run's must agree, unless ``opt`` (``OptimizerConfig``) says whose to keep. With
    --use-checkpoint-opt-param-scheduler the checkpoint's are set on ``schedule`` and
    ``optimizer``'s groups."""
    if not saved:  # --finetune, another framework's checkpoint, or none recorded
        return
    differ = _differences(saved, settings(schedule.lr, optimizer))
    if not differ:
        return
    if opt.override_opt_param_scheduler:
        log_rank0("--override-opt-param-scheduler: this run's %s", "; ".join(differ))
        return
    if not opt.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            f"{source}: the checkpoint's learning-rate schedule has {differ[0]}"
            f"{f' ({len(differ) - 1} more)' if len(differ) > 1 else ''}: give the flags it was "
            "saved with, --use-checkpoint-opt-param-scheduler to take the checkpoint's, or "
            "--override-opt-param-scheduler to keep this run's"
        )
    log_rank0("--use-checkpoint-opt-param-scheduler: the checkpoint's %s", "; ".join(differ))
    schedule.lr = LRSchedule(**saved["lr_schedule"])
    for i, group in enumerate(optimizer.param_groups):
        values = saved["groups"].get(group.get("name", str(i)), {})
        group.update({k: v for k, v in values.items() if k in _GROUP_VALUES})
