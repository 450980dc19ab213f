"""The learning-rate schedule and the batch ramp against Megatron-LM's formulas, written out here
independently (float64 arithmetic on iterations, exact fractions for the ramp), and the flag
checks of --train-iters / --train-samples and the schedule flags."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest

from megatron_tempnet.trainer.config import (
    ConfigError,
    OptimizerConfig,
    RunConfig,
    TrainingConfig,
)
from megatron_tempnet.trainer.schedule import LRSchedule, TrainSchedule, resumed_settings
from megatron_tempnet.trainer.validation import validate_run

PEAK, FLOOR, INIT = 3e-4, 3e-5, 1e-5
GBS, ITERS, WARMUP, DECAY, WSD = 8, 100, 10, 80, 20  # iterations
LR = dict(lr=PEAK, min_lr=FLOOR, lr_warmup_init=INIT)  # the schedules' values
LENGTHS = dict(lr_warmup_iters=WARMUP, lr_decay_iters=DECAY)  # and lengths, in iterations


class Groups:
    """An optimizer's ``param_groups``: the LM's (peak, floor) and TempNet's (10x both)."""

    def __init__(self):
        self.param_groups = [
            {"name": "lm", "max_lr": PEAK, "min_lr": FLOOR, "schedule": "lm", "weight_decay": 0.1},
            {
                "name": "tempnet",
                "max_lr": 10 * PEAK,
                "min_lr": 10 * FLOOR,
                "schedule": "tempnet",
                "weight_decay": 0.0,
            },
        ]


def reference(style: str, k: int, peak: float = PEAK, floor: float = FLOOR, wsd="exponential"):
    """Megatron-LM's lr after ``k`` iterations of a fixed batch, in iterations."""
    if k <= WARMUP:
        return INIT + (peak - INIT) * k / WARMUP
    if style == "constant":
        return peak
    if k > DECAY:
        return floor
    if style == "inverse-square-root":
        return max(floor, peak * math.sqrt(WARMUP / k))
    r = (k - WARMUP) / (DECAY - WARMUP)
    coefficient = {"linear": 1 - r, "cosine": (1 + math.cos(math.pi * r)) / 2}.get(style)
    if style == "WSD":
        q = max(k - (DECAY - WSD), 0) / WSD
        coefficient = {
            "exponential": 2 * 0.5**q - 1,
            "linear": 1 - q,
            "cosine": (1 + math.cos(math.pi * q)) / 2,
            "minus_sqrt": 1 - math.sqrt(q),
        }[wsd]
    return floor + (peak - floor) * coefficient


def run(training: TrainingConfig, optimizer: OptimizerConfig, world_size: int = 1, skip=()):
    """Every iteration's global batch and (LM, TempNet) learning rates."""
    validate_run(RunConfig(training=training, optimizer=optimizer), world_size)
    schedule = TrainSchedule(training.batch_schedule(), LRSchedule.from_config(optimizer, training))
    groups, consumed, rows = Groups(), 0, []
    for iteration in range(1, training.iterations + 1):
        batch = schedule.begin(iteration, consumed)
        rates = schedule.set_learning_rates(groups)
        rows.append((batch, rates["lr"], rates["tempnet_lr"]))
        schedule.end(applied=iteration not in skip)
        consumed += batch
    return rows


def iteration_run(style: str, wsd: str = "exponential", **extra):
    training = TrainingConfig(train_iters=ITERS, global_batch_size=GBS)
    wsd_iters = WSD if style == "WSD" else None
    optimizer = OptimizerConfig(
        **LR,
        **LENGTHS,
        lr_decay_style=style,
        lr_wsd_decay_style=wsd,
        lr_wsd_decay_iters=wsd_iters,
        **extra,
    )
    return run(training, optimizer)


STYLES = ["constant", "linear", "cosine", "inverse-square-root", "WSD"]


@pytest.mark.parametrize("style", STYLES)
def test_every_iteration_follows_megatrons_formula(style):
    rows = iteration_run(style)
    for k, (batch, lr, tempnet_lr) in enumerate(rows):
        assert batch == GBS
        assert lr == pytest.approx(reference(style, k), rel=1e-12, abs=0), k
        # every group has the shape, scaled to its own peak and floor (warm-up from the init)
        want = reference(style, k, 10 * PEAK, 10 * FLOOR)
        assert tempnet_lr == pytest.approx(want, rel=1e-12, abs=0), k


@pytest.mark.parametrize("wsd", ["exponential", "linear", "cosine", "minus_sqrt"])
def test_wsd_decay_styles(wsd):
    rows = iteration_run("WSD", wsd)
    lrs = [lr for _, lr, _ in rows]
    assert lrs[WARMUP : DECAY - WSD + 1] == [PEAK] * (DECAY - WSD - WARMUP + 1)  # stable
    for k in range(DECAY - WSD, ITERS):
        assert lrs[k] == pytest.approx(reference("WSD", k, wsd=wsd), rel=1e-12, abs=0), k
    assert lrs[DECAY] == pytest.approx(FLOOR) and lrs[DECAY + 1 :] == [FLOOR] * 19


def test_hand_computed_values():
    """A few values worked out by hand (peak 3e-4, floor 3e-5, init 1e-5, warm-up 10, decay
    80 iterations)."""
    linear = [lr for _, lr, _ in iteration_run("linear")]
    assert linear[0] == 1e-5  # the warm-up starts at --lr-warmup-init
    assert linear[5] == pytest.approx(1.55e-4)  # 1e-5 + 2.9e-4 / 2
    assert linear[10] == pytest.approx(3e-4)  # the peak where the warm-up ends
    assert linear[45] == pytest.approx(1.65e-4)  # halfway down: 3e-5 + 2.7e-4 / 2
    assert linear[80] == pytest.approx(3e-5) and linear[81] == 3e-5  # then the floor
    cosine = [lr for _, lr, _ in iteration_run("cosine")]
    assert cosine[45] == pytest.approx(1.65e-4)  # cos(pi / 2) = 0
    assert cosine[80] == pytest.approx(3e-5)
    isr = [lr for _, lr, _ in iteration_run("inverse-square-root")]
    assert isr[40] == pytest.approx(1.5e-4)  # 3e-4 x sqrt(10 / 40)
    wsd = [lr for _, lr, _ in iteration_run("WSD")]
    assert wsd[70] == pytest.approx(3e-5 + 2.7e-4 * (2 * 0.5**0.5 - 1))  # halfway through E
    constant = [lr for _, lr, _ in iteration_run("constant")]
    assert constant[99] == 3e-4  # no decay, past the decay length too


def test_samples_and_iterations_give_the_same_schedule():
    for style in STYLES:
        by_iters = iteration_run(style)
        training = TrainingConfig(train_samples=ITERS * GBS, global_batch_size=GBS)
        in_samples = dict(lr_warmup_samples=WARMUP * GBS, lr_decay_samples=DECAY * GBS)
        wsd_samples = WSD * GBS if style == "WSD" else None
        optimizer = OptimizerConfig(
            **LR, **in_samples, lr_decay_style=style, lr_wsd_decay_samples=wsd_samples
        )
        assert run(training, optimizer) == by_iters, style


def test_warmup_fraction_counts_samples_of_the_decay():
    """--lr-warmup-fraction 0.15 of 80 x 8 decay samples: 96 samples, 12 iterations (the
    default decay is the whole run: --train-iters)."""
    training = TrainingConfig(train_iters=ITERS, global_batch_size=GBS)
    optimizer = OptimizerConfig(lr=PEAK, lr_decay_iters=DECAY, lr_warmup_fraction=0.15)
    lrs = [lr for _, lr, _ in run(training, optimizer)]
    assert lrs[6] == pytest.approx(PEAK * 48 / 96) and lrs[12] == pytest.approx(PEAK)
    # linear, the default, to the group's floor
    assert lrs[13] == pytest.approx(FLOOR + (PEAK - FLOOR) * (1 - 8 / (640 - 96)))
    default = OptimizerConfig(lr=PEAK)
    lrs = [lr for _, lr, _ in run(TrainingConfig(train_iters=ITERS), default)]
    assert lrs[0] == PEAK and lrs[50] == pytest.approx((PEAK + FLOOR) / 2)  # no warm-up


def test_a_skipped_step_does_not_advance_the_schedule():
    training = TrainingConfig(train_iters=20, global_batch_size=GBS)
    optimizer = OptimizerConfig(lr=PEAK, lr_warmup_iters=WARMUP)
    rows = run(training, optimizer, skip={3, 4})  # fp16 overflows at iterations 3 and 4
    lrs = [lr for _, lr, _ in rows]
    assert lrs[2:6] == pytest.approx([PEAK * 2 / 10] * 3 + [PEAK * 3 / 10])


def test_the_schedule_resumes_where_it_stopped():
    training = TrainingConfig(train_samples=400, global_batch_size=16, rampup_batch_size=(4, 4, 64))
    optimizer = OptimizerConfig(lr=PEAK, lr_decay_style="cosine", lr_warmup_samples=40)
    validate_run(RunConfig(training=training, optimizer=optimizer), 1)
    lr = LRSchedule.from_config(optimizer, training)
    whole = TrainSchedule(training.batch_schedule(), lr)
    consumed, saved, rows = 0, None, []
    for iteration in range(1, training.iterations + 1):
        if iteration == 7:
            saved = (whole.state_dict(), consumed)
        batch = whole.begin(iteration, consumed)
        rows.append((batch, whole.set_learning_rates(Groups())["lr"]))
        whole.end(applied=iteration != 2)
        consumed += batch
    resumed = TrainSchedule(training.batch_schedule(), lr)
    resumed.load_state_dict(*saved)
    consumed = saved[1]
    for iteration in range(7, training.iterations + 1):
        batch = resumed.begin(iteration, consumed)
        assert (batch, resumed.set_learning_rates(Groups())["lr"]) == rows[iteration - 1]
        resumed.end(applied=True)
        consumed += batch
    # a checkpoint from before the schedule was saved: every consumed sample was stepped on
    old = TrainSchedule(training.batch_schedule(), lr)
    old.load_state_dict(None, 56)
    assert old.state_dict() == {"stepped_samples": 56}


def test_a_resume_keeps_its_schedule_unless_a_flag_says_whose():
    """Megatron-LM's rule for the scheduler of a resume: the checkpoint's peak, floor, lengths,
    style and weight decay must be the run's; --use-checkpoint-opt-param-scheduler takes the
    checkpoint's (the lrs then follow Megatron-LM's formula of the saved flags),
    --override-opt-param-scheduler keeps the run's."""
    training = TrainingConfig(train_iters=ITERS, global_batch_size=GBS)
    flags = dict(**LR, **LENGTHS, lr_decay_style="cosine")
    first = OptimizerConfig(**flags)
    saved = TrainSchedule(training.batch_schedule(), LRSchedule.from_config(first, training))
    settings = saved.state_dict(Groups())["settings"]
    resumed_settings(saved, Groups(), settings, first, "--load X")  # the same: nothing to do

    def resume(**override):
        opt = OptimizerConfig(**{**flags, "lr": 2 * PEAK, "lr_decay_iters": 2 * DECAY, **override})
        schedule = TrainSchedule(training.batch_schedule(), LRSchedule.from_config(opt, training))
        groups = Groups()
        groups.param_groups[0]["max_lr"] = 2 * PEAK
        resumed_settings(schedule, groups, settings, opt, "--load X")
        return schedule, groups

    with pytest.raises(ConfigError) as e:
        resume()
    assert str(e.value).startswith(
        "--load X: the checkpoint's learning-rate schedule has decay samples (--lr-decay-iters "
        f"or --train-iters x the global batch, or --lr-decay-samples) {DECAY * GBS} (this run: "
        f"{2 * DECAY * GBS}) (1 more): give the flags it was saved with, "
        "--use-checkpoint-opt-param-scheduler"
    )
    schedule, groups = resume(override_opt_param_scheduler=True)
    assert schedule.lr.decay == 2 * DECAY * GBS and groups.param_groups[0]["max_lr"] == 2 * PEAK
    schedule, groups = resume(use_checkpoint_opt_param_scheduler=True)
    assert groups.param_groups[0]["max_lr"] == PEAK
    for k in (0, 5, 10, 40, 80, 90):
        schedule.stepped_samples = k * GBS
        lr = schedule.set_learning_rates(groups)["lr"]
        assert lr == pytest.approx(reference("cosine", k), rel=1e-12), k
    with pytest.raises(ConfigError, match="choose opposite schedules on resume: give one"):
        both = dict(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True)
        validate_run(RunConfig(training=training, optimizer=OptimizerConfig(**flags, **both)), 1)


def megatron_ramp(consumed: int, start: int, increment: int, samples: int, gbs: int) -> int:
    """Megatron-LM's ramp in exact fractions: ``start + increment x floor(consumed / (samples /
    increments))`` until ``consumed > samples``."""
    if consumed > samples:
        return gbs
    per_increment = Fraction(samples, (gbs - start) // increment)
    return start + increment * math.floor(Fraction(consumed) / per_increment)


def megatron_iterations(train_samples: int, start, increment, samples, gbs) -> int:
    """``update_train_iters``: the ramp's iterations, then whole global batches."""
    iterations = consumed = 0
    while consumed <= samples and consumed <= train_samples:
        consumed += megatron_ramp(consumed, start, increment, samples, gbs)
        iterations += 1
    return iterations + max(train_samples - consumed, 0) // gbs


@pytest.mark.parametrize(
    "ramp,gbs,train_samples,dp",
    [((4, 4, 64), 16, 400, 2), ((16, 16, 5859375), 1536, 146484375, 16), ((8, 8, 300), 32, 200, 1)],
    ids=["small", "gpt3-175b", "ends-in-the-ramp"],
)
def test_ramped_batches_and_consumed_samples(ramp, gbs, train_samples, dp):
    training = TrainingConfig(
        train_samples=train_samples, global_batch_size=gbs, rampup_batch_size=ramp
    )
    optimizer = OptimizerConfig(lr=PEAK)
    validate_run(RunConfig(training=training, optimizer=optimizer), dp)
    assert training.iterations == megatron_iterations(train_samples, *ramp, gbs)
    schedule = training.batch_schedule()
    consumed = 0
    for iteration in range(training.iterations):
        batch = schedule.batch_size(consumed)
        assert batch == megatron_ramp(consumed, *ramp, gbs), iteration
        consumed += batch
        if consumed > ramp[2] + gbs:  # past the ramp: the rest is arithmetic
            consumed += (training.iterations - iteration - 1) * gbs
            break
    assert schedule.consumed(training.iterations) == consumed
    assert training.train_samples_needed() == max(train_samples, consumed)


def test_small_ramp_by_hand():
    """4 4 64 up to 16: 64 / 3 samples per increment; batches 4 x 6 (to 24 samples), 8 x 3 (to
    48), 12 x 2 (to 72 > 64), then 16."""
    training = TrainingConfig(train_samples=400, global_batch_size=16, rampup_batch_size=(4, 4, 64))
    rows = run(training, OptimizerConfig(lr=PEAK), 2)
    batches = [batch for batch, _, _ in rows]
    assert batches[:12] == [4] * 6 + [8] * 3 + [12] * 2 + [16]
    assert len(batches) == 11 + (400 - 72) // 16


def test_a_ramp_with_train_iters():
    """--train-iters 10 with the ramp 4 4 64 up to 16: the batches ramp by consumed samples
    (4 x 6, 8 x 3, 12), the schedule counts --lr-*-iters x --global-batch-size samples (warm-up
    2 x 16 = 32, decay 10 x 16 = 160), stepped by each iteration's own batch (Megatron-LM's
    conversion; Megatron-LM itself refuses a ramp with --train-iters)."""
    training = TrainingConfig(train_iters=10, global_batch_size=16, rampup_batch_size=(4, 4, 64))
    optimizer = OptimizerConfig(lr=PEAK, min_lr=0.0, lr_warmup_iters=2)
    rows = run(training, optimizer)
    batches = [batch for batch, _, _ in rows]
    assert batches == [4] * 6 + [8] * 3 + [12]
    assert training.train_samples_needed() == 60
    stepped = [sum(batches[:k]) for k in range(10)]  # 0, 4, ..., 24, 32, 40
    floor = FLOOR  # the groups' floor
    want = [
        PEAK * s / 32 if s <= 32 else floor + (PEAK - floor) * (1 - (s - 32) / (160 - 32))
        for s in stepped
    ]
    assert [lr for _, lr, _ in rows] == pytest.approx(want, rel=1e-12, abs=0)


@pytest.mark.parametrize(
    "training,optimizer,message",
    [
        ({}, {}, "one of --train-iters and --train-samples"),
        ({"train_iters": 5, "train_samples": 50}, {}, "one of --train-iters and --train-samples"),
        ({"train_iters": 5}, {"lr_decay_samples": 10}, "--lr-decay-samples cannot be used"),
        ({"train_iters": 5}, {"lr_warmup_samples": 10}, "--lr-warmup-samples cannot be used"),
        ({"train_samples": 50}, {"lr_decay_iters": 3}, "--lr-decay-iters cannot be used"),
        ({"train_samples": 50}, {"lr_warmup_iters": 3}, "--lr-warmup-iters cannot be used"),
        ({"train_samples": 0}, {}, "--train-samples (0) must be >= 1"),
        ({"train_samples": 3, "global_batch_size": 4}, {}, "less than one global batch"),
        ({"train_iters": 5}, {"lr": None}, "--lr is required"),
        ({"train_iters": 5}, {"min_lr": 2.0}, "--min-lr (2.0) must be in [0, --lr (1.0)]"),
        ({"train_iters": 5}, {"lr_warmup_init": 2.0}, "--lr-warmup-init (2.0) must be <="),
        ({"train_iters": 5}, {"lr_warmup_iters": 5}, "the warm-up (5 samples) must end before"),
        ({"train_iters": 5}, {"lr_warmup_fraction": 0.1, "lr_warmup_iters": 1}, "give one of"),
        ({"train_iters": 5}, {"lr_warmup_fraction": 1.0}, "must be in [0, 1)"),
        ({"train_iters": 5}, {"lr_decay_style": "WSD"}, "needs --lr-wsd-decay-iters"),
        ({"train_samples": 50}, {"lr_decay_style": "WSD"}, "needs --lr-wsd-decay-samples"),
        ({"train_iters": 5}, {"lr_decay_style": "exp"}, "--lr-decay-style 'exp'"),
        (
            {"train_samples": 50, "global_batch_size": 8, "rampup_batch_size": (2, 2)},
            {},
            "give three numbers",
        ),
        (
            {"train_samples": 50, "global_batch_size": 8, "rampup_batch_size": (8, 2, 10)},
            {},
            "START must be below --global-batch-size (8)",
        ),
        (
            {"train_samples": 50, "global_batch_size": 8, "rampup_batch_size": (2, 4, 10)},
            {},
            "in steps of INCREMENT",
        ),
        (
            {"train_samples": 50, "global_batch_size": 8, "rampup_batch_size": (2, 2, 0)},
            {},
            "must be >= 1",
        ),
        (
            {
                "train_samples": 50,
                "global_batch_size": 8,
                "micro_batch_size": 2,
                "rampup_batch_size": (2, 3, 10),
            },
            {},
            "the batch of 5 samples is not a multiple",
        ),
    ],
)
def test_flag_checks(training, optimizer, message):
    config = RunConfig(
        training=TrainingConfig(**training), optimizer=OptimizerConfig(**{"lr": 1.0, **optimizer})
    )
    with pytest.raises(ConfigError) as e:
        validate_run(config, 1)
    assert message in str(e.value)


def test_megatron_defaults():
    o = OptimizerConfig()
    assert (o.lr, o.min_lr, o.lr_warmup_init) == (None, 0.0, 0.0)
    assert (o.lr_decay_style, o.lr_wsd_decay_style) == ("linear", "exponential")
    assert (o.lr_warmup_fraction, o.lr_warmup_iters, o.lr_warmup_samples) == (None, 0, 0)
    assert (o.lr_decay_iters, o.lr_decay_samples) == (None, None)
    assert (o.lr_wsd_decay_iters, o.lr_wsd_decay_samples) == (None, None)
    assert (o.weight_decay, o.clip_grad) == (0.01, 1.0)
    assert (o.adam_beta1, o.adam_beta2, o.adam_eps) == (0.9, 0.999, 1e-8)
    t = TrainingConfig()
    assert (t.train_iters, t.train_samples, t.rampup_batch_size) == (None, None, None)
    assert (t.recompute_granularity, t.recompute_method, t.recompute_num_layers) == (None,) * 3


def test_clip_refuses_the_flags_it_cannot_use_by_name():
    """pretrain_clip.py's --help leaves out a language model's flags and the features not built
    for CLIP, and the command line refuses them with the reason, before anything starts."""
    from megatron_tempnet.models.clip.arguments import build_clip_parser
    from megatron_tempnet.utils.flag_parser import FlagError

    parser = build_clip_parser()
    help_text = parser.format_help()
    argv = ["--model", "clip-tiny", "--train-data", "t", "--tokenizer-type", "GPT2BPETokenizer"]
    argv += ["--train-iters", "4", "--lr", "1e-3"]
    refused = {
        "--sequence-parallel": [],
        "--rampup-batch-size": ["4", "4", "8"],
        "--eval-iters": ["3"],
        "--no-bias-swiglu-fusion": [],
        "--no-bias-gelu-fusion": [],
        "--decoupled-lr": ["1e-4"],
    }
    reasons = {
        "--sequence-parallel": "built for pretrain_gpt.py only",
        "--rampup-batch-size": "not built for CLIP: its epochs are cut into whole global",
        "--eval-iters": "pretrain_clip.py evaluates on the whole --valid-data",
        "--no-bias-gelu-fusion": "CLIP's MLPs have neither SwiGLU nor the tanh GELU",
        "--decoupled-lr": "a learning rate for an LM's input embedding",
    }
    for flag, values in refused.items():
        assert flag not in help_text, flag
        with pytest.raises(FlagError, match=re.escape(flag) + ": " + reasons.get(flag, "")):
            parser.parse_args([*argv, flag, *values])
    parser.parse_args(argv)  # the rest is fine


def test_tempnet_constant_lr_keeps_its_peak_while_the_lm_follows_the_schedule():
    """--tempnet-constant-lr: the optimizer's groups as the engine builds them."""
    import torch

    from megatron_tempnet.trainer.engine import build_optimizer, model_and_own_groups

    lm, tempnet = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    module = torch.nn.ModuleDict({"lm": lm, "tempnet": tempnet})
    optimizer = OptimizerConfig(**LR, **LENGTHS, lr_decay_style="cosine")
    own = {"tempnet": (list(tempnet.parameters()), 10 * PEAK, 0.0)}
    for constant in (frozenset(), frozenset({"tempnet"})):
        groups = model_and_own_groups(module, optimizer, "lm", own, constant)
        adamw = build_optimizer(groups, optimizer)
        training = TrainingConfig(train_iters=ITERS, global_batch_size=GBS)
        lr = LRSchedule.from_config(optimizer, training)
        schedule = TrainSchedule(training.batch_schedule(), lr)
        for k in range(ITERS):
            rates = schedule.set_learning_rates(adamw)
            assert rates["lr"] == pytest.approx(reference("cosine", k), rel=1e-12)
            if constant:
                assert rates["tempnet_lr"] == 10 * PEAK
            else:
                expected = reference("cosine", k, 10 * PEAK, 10 * FLOOR)
                assert rates["tempnet_lr"] == pytest.approx(expected, rel=1e-12)
            schedule.begin(k + 1, k * GBS)
            schedule.end(applied=True)
