"""The package's shape: no import cycles, no upward imports, private upstream symbols in compat/
only, every flag of both entry points with help text and its Megatron-LM name, and no reference
to a design document outside the repository."""

from __future__ import annotations

import ast
import glob
import os
import re
import sys

import pytest

import megatron_tempnet
from tests.helpers.entry_points import run_command
from tests.helpers.imports import cycles, import_graph, package_graph

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.dirname(megatron_tempnet.__file__)

# what each part of the library may import (besides itself): lower layers only
ALLOWED = {
    "utils": set(),
    "compat": {"utils"},
    "distributed": {"utils"},
    "data": {"utils"},
    "losses": {"distributed", "utils"},
    "tempnet": {"distributed", "utils"},
    "checkpoint": {"compat", "distributed", "utils"},
    "trainer": {"checkpoint", "compat", "data", "distributed", "utils"},
    "models": {
        "checkpoint",
        "compat",
        "data",
        "distributed",
        "losses",
        "tempnet",
        "trainer",
        "utils",
    },
    "inference": {  # checkpoints and models, never the trainer
        "checkpoint",
        "compat",
        "data",
        "distributed",
        "losses",
        "models",
        "tempnet",
        "utils",
    },
}


@pytest.fixture(scope="module")
def graph():
    return import_graph(PACKAGE, "megatron_tempnet")


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_no_import_cycles_between_modules_or_packages(graph):
    assert len(graph) > 50  # the whole package was read
    assert cycles(graph) == []
    for depth in (2, 3):  # megatron_tempnet.trainer, megatron_tempnet.models.gpt, ...
        assert cycles(package_graph(graph, depth)) == [], depth


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """The check above can fail: a package whose modules import each other (one of them inside
    a function, where a cycle usually hides) is reported."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg.sub.c import g\n")
    (pkg / "sub" / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg import a\n")
    g = import_graph(str(pkg), "pkg")
    assert g["pkg.d"] == {"pkg.a"}
    assert cycles(g) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    assert cycles(package_graph(g, 2)) == [["pkg.a", "pkg.sub"]]


def test_no_upward_imports(graph):
    """The trainer knows nothing of the model families, TempNet or inference; the families do
    not import each other; the library never imports the entry points, tools or tests."""
    wrong = []
    for module, targets in graph.items():
        part = _part(module)
        for target in targets:
            other = _part(target)
            if other != part and part in ALLOWED and other not in ALLOWED[part]:
                wrong.append(f"{module} -> {target}")
            families = {_family(module), _family(target)}
            if part == other == "models" and families == {"gpt", "clip"}:
                wrong.append(f"{module} -> {target}")
    assert wrong == []
    sources = [os.path.join(d, f) for d, _, fs in os.walk(PACKAGE) for f in fs if f.endswith(".py")]
    pattern = re.compile(r"^\s*(from|import)\s+(pretrain_gpt|pretrain_clip|tools|tests)\b", re.M)
    assert [p for p in sources if pattern.search(open(p).read())] == []


UPSTREAM = ("megatron", "deepspeed")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_upstream_uses(source: str, path: str = "<source>") -> list[str]:
    """Where ``source`` reaches a private megatron-core or DeepSpeed symbol: a private name
    imported from them, a private attribute of a name imported from them, or a private
    attribute named in ``getattr``/``hasattr``/``setattr`` (an upstream object's, since the
    project's own objects are reached directly)."""
    tree = ast.parse(source, path)
    upstream, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(UPSTREAM):
            for alias in node.names:
                if _private(alias.name) or any(map(_private, node.module.split("."))):
                    found.append(f"{path}:{node.lineno}: from {node.module} import {alias.name}")
                upstream.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(UPSTREAM):
                    upstream.add((alias.asname or alias.name).split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in upstream:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_private_upstream_symbols_live_in_compat_only():
    """``megatron_tempnet/compat/`` names (and checks at start-up) every private symbol of
    megatron-core and DeepSpeed the project uses; nothing else in the library touches one."""
    found = []
    for folder, _, files in os.walk(PACKAGE):
        if os.path.relpath(folder, PACKAGE).split(os.sep)[0] == "compat":
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found += private_upstream_uses(open(path).read(), os.path.relpath(path, REPO))
    assert found == []
    compat = os.path.join(PACKAGE, "compat")
    in_compat = []
    for name in os.listdir(compat):
        if name.endswith(".py"):
            in_compat += private_upstream_uses(open(os.path.join(compat, name)).read(), name)
    assert len(in_compat) >= 10  # the check sees them where they are allowed


def test_the_private_symbol_check_finds_each_kind():
    source = """
from deepspeed.runtime.engine import DeepSpeedEngine
from megatron.core.tensor_parallel import random as mc_random
from megatron.core.utils import _private_helper
import deepspeed
DeepSpeedEngine._cast_module_mixed_precision
mc_random._CUDA_RNG_STATE_TRACKER
deepspeed.runtime._x
hasattr(param, "_hp_mapping")
self._own
torch._foreach_mul_
"""
    assert private_upstream_uses(source) == [
        "<source>:4: from megatron.core.utils import _private_helper",
        "<source>:6: DeepSpeedEngine._cast_module_mixed_precision",
        "<source>:7: mc_random._CUDA_RNG_STATE_TRACKER",
        "<source>:8: deepspeed.runtime._x",
        "<source>:9: hasattr(param, '_hp_mapping')",
    ]


def _family(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "models" else None


def _parsers():
    from megatron_tempnet.models.clip.arguments import build_clip_parser
    from megatron_tempnet.models.gpt.arguments import build_parser

    return {"pretrain_gpt.py": build_parser(), "pretrain_clip.py": build_clip_parser()}


def _options(parser) -> dict[str, str]:
    return {
        flag: action.help or ""
        for action in parser._actions
        for flag in action.option_strings
        if flag not in ("-h", "--help")
    }


GPT_FLAGS = """adam-beta1 adam-beta2 adam-eps async-save checkpoint-timeout-minutes decoupled-lr
decoupled-min-lr deepspeed-activation-checkpointing checkpoint-activations checkpoint-num-layers
partition-activations contigious-checkpointing synchronize-each-layer no-pipeline-parallel
override-opt-param-scheduler use-checkpoint-opt-param-scheduler DDP-impl checkpoint-in-cpu
create-moe-param-group disable-moe-token-dropping num-experts hysteresis initial-loss-scale
loss-scale loss-scale-window min-loss-scale log-batch-size-to-tensorboard
log-optimizer-states-to-tensorboard log-timers-to-tensorboard log-validation-ppl-to-tensorboard
tensorboard-queue-size timing-log-level no-async-tensor-model-parallel-allreduce
override-opt_param-scheduler rotary-position-embeddings-theta use-flash-attn-triton
use-flash-attn-v2 ckpt-assume-constant-structure ckpt-digest ckpt-format ckpt-fully-parallel-load
no-ckpt-fully-parallel-save use-persistent-ckpt-worker apply-layernorm-1p
apply-query-key-layer-scaling attention-backend attention-dropout attention-softmax-in-fp32 bf16
calculate-per-token-loss clip-grad context-parallel-size cross-entropy-loss-fusion data-cache-path
data-impl data-path deepspeed deepspeed-config deepspeed_config disable-bias-linear
distributed-backend distributed-timeout-minutes empty-unused-memory-level eod-mask-loss
eval-interval eval-iters exit-duration-in-mins exit-interval exit-on-missing-checkpoint
expert-model-parallel-size ffn-hidden-size finetune fixed-tau fp16 freeze-lm frozen-lm-cache
global-batch-size grad-reduce-in-bf16 group-query-attention hidden-dropout hidden-size
init-method-std keep-last kv-channels load load-fallback log-interval log-throughput loss lr
lr-decay-iters lr-decay-samples lr-decay-style lr-warmup-fraction lr-warmup-init lr-warmup-iters
lr-warmup-samples lr-wsd-decay-iters lr-wsd-decay-samples lr-wsd-decay-style
make-vocab-size-divisible-by manual-gc manual-gc-interval max-position-embeddings merge-file
metrics-file micro-batch-size min-lr mock-data model no-bias-dropout-fusion no-bias-gelu-fusion
no-bias-swiglu-fusion no-create-attention-mask-in-dataloader no-fused-output-stage
no-gradient-accumulation-fusion no-load-optim no-load-rng no-manual-gc-eval no-masked-softmax-fusion
no-mmap-bin-files no-position-embedding no-query-key-layer-scaling no-rope-fusion
no-tempnet-stop-grad norm-epsilon normalization num-attention-heads num-key-value-heads num-layers
num-query-groups num-workers openai-gelu optimizer output-stage-chunk-size overlap-grad-reduce
overlap-param-gather pipeline-model-parallel-size position-embedding-type pretrained-checkpoint
profile profile-ranks profile-step-end profile-step-start rampup-batch-size recompute-activations
recompute-granularity recompute-method recompute-num-layers reset-attention-mask reset-position-ids
rope-scaling-factor rope-scaling-high-freq-factor rope-scaling-low-freq-factor
rope-scaling-original-max-position-embeddings rotary-base rotary-percent save save-interval seed
seq-length sequence-parallel split swiglu tau-source tempnet-constant-lr tempnet-dropout
tempnet-hidden-size tempnet-lr tempnet-proj-size tempnet-rho tempnet-tau-max tempnet-tau-min
tempnet-weight-decay tensor-model-parallel-size tensorboard-dir tiktoken-pattern tokenizer-model
tokenizer-type train-iters train-samples transformer-impl untie-embeddings-and-output-weights
use-checkpoint-args use-distributed-optimizer use-flash-attn use-mcore-models use-pytorch-profiler
use-rope-scaling use-rotary-position-embeddings use-tempnet vocab-file vocab-size wandb-entity
wandb-exp-name wandb-project wandb-save-dir weight-decay yaml-cfg zero-stage"""
CLIP_FLAGS = """adam-beta1 adam-beta2 adam-eps async-save checkpoint-timeout-minutes ckpt-digest
ckpt-format override-opt-param-scheduler use-checkpoint-opt-param-scheduler
override-opt_param-scheduler hysteresis initial-loss-scale loss-scale loss-scale-window
min-loss-scale
 attention-backend bf16 caption-key caption-noise
clip-grad clip-loss context-length data-cache-path deepspeed-config deepspeed_config
distributed-timeout-minutes embed-dim empty-unused-memory-level eval-batch-size eval-interval
exit-duration-in-mins exit-interval exit-on-missing-checkpoint finetune fp16
global-batch-size grad-reduce-in-bf16 image-augment image-channels image-key image-mean image-size
image-std init-method-std isogclr-grad-clip isogclr-tau-beta isogclr-tau-lr isogclr-tau-max
isogclr-tau-min keep-last label-key load load-fallback log-interval log-throughput lr
lr-decay-iters lr-decay-samples lr-decay-style lr-warmup-fraction lr-warmup-init lr-warmup-iters
lr-warmup-samples lr-wsd-decay-iters lr-wsd-decay-samples lr-wsd-decay-style
make-vocab-size-divisible-by manual-gc manual-gc-interval merge-file metrics-file micro-batch-size
min-lr model no-bias-dropout-fusion no-load-optim
no-load-rng no-manual-gc-eval num-workers ood-data overlap-grad-reduce overlap-param-gather
patch-size pipeline-model-parallel-size pretrained-checkpoint profile profile-ranks
profile-step-end profile-step-start quick-gelu recompute-activations
recompute-granularity recompute-method recompute-num-layers save save-interval seed
skip-bad-samples sogclr-gamma tau-init tempnet-constant-lr tempnet-lr
tempnet-proj-size tempnet-rho
tempnet-tau-max tempnet-tau-min tempnet-weight-decay tensor-model-parallel-size tensorboard-dir
text-heads text-hidden-size text-layers tokenizer-model tokenizer-type train-data train-iters
train-samples use-checkpoint-args use-pytorch-profiler valid-data vision-heads vision-hidden-size
vision-layers vocab-file vocab-size wandb-entity wandb-exp-name wandb-project wandb-save-dir
weight-decay yaml-cfg zero-stage zeroshot-templates"""


def test_every_flag_has_help_and_keeps_its_name():
    expected = {"pretrain_gpt.py": GPT_FLAGS, "pretrain_clip.py": CLIP_FLAGS}
    for script, parser in _parsers().items():
        options = _options(parser)
        assert sorted(options) == sorted("--" + f for f in expected[script].split()), script
        silent = [flag for flag, text in options.items() if len(text.split()) < 2]
        assert silent == [], f"{script}: flags without help text"


# sbatch's and srun's options in the example scripts
LAUNCHER_OPTIONS = """array cpus-per-task gpus-per-node gpus-per-task job-name kill-on-bad-exit
nodes ntasks ntasks-per-node open-mode output requeue signal time wait""".split()


def test_help_prints_and_example_scripts_use_only_known_flags():
    for script in _parsers():
        r = run_command([sys.executable, os.path.join(REPO, script), "--help"])
        assert r.returncode == 0 and "--tempnet-tau-min" in r.stdout, r.stderr[-2000:]
        assert "(default: 0.001)" in r.stdout  # the dataclass default, shown once
    known = {f for parser in _parsers().values() for f in _options(parser)}
    known |= {"--" + option for option in LAUNCHER_OPTIONS}
    used = set()
    for folder, _, files in os.walk(os.path.join(REPO, "examples")):
        for name in files:
            if name.endswith(".sh"):
                text = open(os.path.join(folder, name)).read()
                used |= set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", text))
    assert len(used) > 40 and sorted(used - known) == []


OUTSIDE_DOCUMENTS = ("DESIGN" + ".md", ".." + "/shared")  # spelled so that this file has none


def test_no_reference_to_a_design_document_outside_the_repository():
    skip = {".git", ".venv", "runs", "build", "__pycache__", ".pytest_cache", ".ruff_cache"}
    offenders = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
        for name in files:
            path = os.path.join(folder, name)
            if path == os.path.join(REPO, "docs", "design.md"):
                continue
            try:
                text = open(path, encoding="utf-8").read()
            except (UnicodeDecodeError, OSError):
                continue
            if any(name in text for name in OUTSIDE_DOCUMENTS):
                offenders.append(os.path.relpath(path, REPO))
    assert offenders == [] and os.path.isfile(os.path.join(REPO, "docs", "design.md"))


def _design_tree() -> set[str]:
    """The paths docs/design.md's package tree names (its ``megatron_tempnet/`` block: an entry is
    a line whose first words are file or folder names; the indentation gives the folder)."""
    with open(os.path.join(REPO, "docs", "design.md")) as f:
        text = f.read()
    block = text[text.index("    megatron_tempnet/\n") :]
    block = block[: block.index("\n\n")]
    name = r"[A-Za-z_][\w]*(?:\.py|/)"
    entry = re.compile(rf"^( *)({name}(?:, {name})*)(?:\s|$)")
    folders: list[tuple[int, str]] = []
    named = set()
    for line in block.splitlines():
        m = entry.match(line)
        if not m:
            continue
        while folders and folders[-1][0] >= len(m[1]):
            folders.pop()
        names = m[2].split(", ")
        named |= {"".join(f for _, f in folders) + n for n in names}
        if names[-1].endswith("/"):
            folders.append((len(m[1]), names[-1]))
    return named


def test_the_design_documents_package_tree_names_every_module():
    named = _design_tree()
    modules = {
        os.path.relpath(os.path.join(d, f), REPO)
        for d, _, files in os.walk(PACKAGE)
        for f in files
        if f.endswith(".py") and f != "__init__.py"
    }
    assert "megatron_tempnet/trainer/loop.py" in named and len(named) > 100
    assert sorted(modules - named) == []
    assert sorted(n for n in named if not os.path.exists(os.path.join(REPO, n))) == []


def test_the_checkpoint_tools_and_readers_do_not_import_the_trainer():
    """Reading and converting checkpoints needs the checkpoint package, not the trainer: the
    checkpoint tools, the TempNet export and the checkpoint-args reader import none of it."""
    paths = glob.glob(os.path.join(REPO, "tools", "checkpoint", "*.py"))
    paths += [os.path.join(REPO, "tools", "export_tempnet.py")]
    paths += [os.path.join(PACKAGE, "models", "gpt", "checkpoint_args.py")]
    assert len(paths) >= 6
    for path in paths:
        with open(path) as f:
            tree = ast.parse(f.read())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m.startswith("megatron_tempnet.trainer")], path
