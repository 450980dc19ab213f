"""pretrain_gpt.py's optimizer groups on every pipeline stage: --decoupled-lr gives the weights
megatron-core's own ``GPTModel`` marks ``is_embedding_or_output_parameter`` (the word embeddings,
and the output layer when untied) their own group, peak and floor; a stage holding neither gets
a zero placeholder, so every stage has every group (DeepSpeed reduces the norm per group)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.helpers.distributed import run_distributed

FLAGS = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 96 --num-layers 4 --hidden-size 32 "
    "--num-attention-heads 2 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 1 "
    "--train-iters 4 --lr 3e-4 --min-lr 3e-5 --weight-decay 0.1 --decoupled-lr 1e-3 "
    "--decoupled-min-lr 1e-4 --loss ce --tau-source fixed --num-workers 0"
).split()


def _groups(extra: list[str]) -> dict:
    """This stage's groups: name -> (parameter names, peak, floor, weight decay)."""
    import os

    import deepspeed

    from megatron_tempnet.models.gpt.arguments import build_parser, config_from_args
    from megatron_tempnet.models.gpt.task import GPTTask
    from megatron_tempnet.trainer.engine import init_process_groups
    from megatron_tempnet.utils.yaml_cfg import parse_with_yaml

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # DeepSpeed's
    deepspeed.init_distributed(dist_backend="gloo")  # over this process group
    config = config_from_args(parse_with_yaml(build_parser(), FLAGS + extra))
    task = GPTTask()
    task.prepare(config, world)
    init_process_groups(config)
    model = task.build_model(config, None)
    names = {id(p): n for n, p in model.module.named_parameters()}
    return {
        g.name: (sorted(names[id(p)] for p in g.params), g.lr, g.min_lr, g.weight_decay)
        for g in model.param_groups
    }


def _stages(world: int, extra: list[str]) -> list[dict]:
    pp = ["--pipeline-model-parallel-size", str(world)]
    return run_distributed(_groups, world, args=(extra + pp,), timeout=300)


def _ends(names: list[str]) -> list[str]:
    return [n for n in names if n.endswith(("word_embeddings.weight", "output_layer.weight"))]


def _kind(name: str) -> str:
    """``...word_embeddings.weight`` -> ``word_embeddings``; a group's placeholder."""
    return "placeholder" if name.endswith("_group_placeholder") else name.split(".")[-2]


@pytest.mark.parametrize(
    ("world", "extra", "expected"),
    [
        # GPT-2's tied embeddings on 4 stages: the first and last hold the shared weight
        (4, [], [["word_embeddings"], ["placeholder"], ["placeholder"], ["word_embeddings"]]),
        # LLaMA's untied output layer on 2 stages: the embeddings first, the output layer last
        (2, ["--untie-embeddings-and-output-weights"], [["word_embeddings"], ["output_layer"]]),
    ],
)
def test_decoupled_lr_groups_the_input_and_output_layers_on_every_stage(world, extra, expected):
    stages = _stages(world, extra)
    for stage, want in zip(stages, expected):
        names, peak, floor, decay = stage["decoupled"]
        assert [_kind(n) for n in names] == want, names
        assert (peak, floor, decay) == (1e-3, 1e-4, 0.1)
        lm = [n for group in ("lm", "lm_no_decay") for n in stage.get(group, ([],))[0]]
        assert lm and not _ends(lm)  # every other weight stays on --lr
        assert stage["lm"][1:] == (3e-4, 3e-5, 0.1)
    assert {frozenset(s) for s in stages} == {frozenset(stages[0])}  # the same groups everywhere
