"""Megatron-LM checkpoints written in a test, as Megatron-LM's ``save_checkpoint`` lays them out.

No Megatron-LM checkout is available: the model is megatron-core's own ``GPTModel`` (local layer
spec) at the calling ranks' TP x PP, its weights saved

- ``torch_dist``: ``dist_checkpointing.save`` of ``{"model": sharded_state_dict, "args": ...,
  "iteration": ..., "checkpoint_version": 3.0}`` into ``iter_XXXXXXX/`` (megatron-core writes
  ``.metadata``, ``__*.distcp``, ``common.pt`` and ``metadata.json``);
- ``torch`` (legacy): every rank's ``state_dict`` in ``iter_XXXXXXX/mp_rank_TT[_PPP]/
  model_optim_rng.pt``, optionally under Transformer Engine's names (the norms fused into
  ``linear_qkv``/``linear_fc1``, as the TE layer spec names them);

and ``latest_checkpointed_iteration.txt`` beside. megatron-core's torch_dist writer calls
``torch.cuda.synchronize()`` and makes a tensor on ``torch.cuda.current_device()``: on CPU both
are stood in for while it writes (``cuda_stand_ins``).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
from unittest import mock

import torch
import torch.distributed as dist
from megatron.core import parallel_state

ITERATION = 40
TE_NORMS = {
    ".input_layernorm.": ".self_attention.linear_qkv.layer_norm_",
    ".pre_mlp_layernorm.": ".mlp.linear_fc1.layer_norm_",
}


def megatron_args(model, *, tp: int, pp: int, vocab_size: int) -> argparse.Namespace:
    """The args Megatron-LM saves for ``model`` (a ``ModelConfig``), NullTokenizer of
    ``vocab_size`` (its ids: ``vocab_size + 1``)."""
    return argparse.Namespace(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        group_query_attention=model.num_query_groups is not None,
        num_query_groups=model.num_query_groups or 1,
        kv_channels=model.hidden_size // model.num_attention_heads,
        seq_length=model.seq_length,
        max_position_embeddings=model.max_position_embeddings,
        position_embedding_type=model.position_embedding_type,
        rotary_base=model.rotary_base,
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=model.use_rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
        normalization=model.normalization,
        norm_epsilon=model.norm_epsilon,
        apply_layernorm_1p=model.apply_layernorm_1p,
        swiglu=model.swiglu,
        openai_gelu=model.openai_gelu,
        squared_relu=False,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=False,
        untie_embeddings_and_output_weights=model.untie_embeddings_and_output_weights,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
        padded_vocab_size=model.padded_vocab_size(tp),
        tokenizer_type="NullTokenizer",
        vocab_size=vocab_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        transformer_impl="local",
        num_experts=None,
        params_dtype=torch.float32,
        spec=None,
    )


def build_gpt_model(model, *, tp: int, pp: int, seed: int = 11):
    """megatron-core's ``GPTModel`` of ``model`` (a ``ModelConfig``): this rank's TP shard of
    its pipeline stage (megatron-core's groups initialised at TP x PP)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.gpt import transformer_config

    apply_cpu_support()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    config = transformer_config(model, tensor_parallel_size=tp)
    config.pipeline_model_parallel_size = pp
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    # tied embeddings at PP > 1: megatron-core all-reduces the output layer's copy over the
    # embedding group after moving it with ``.cuda()``, which stays on the CPU here
    with mock.patch.object(torch.Tensor, "cuda", lambda t, *a, **k: t):
        gpt = _gpt_model(model, config, tp)
    _distinct(gpt, seed)
    return gpt


def _distinct(gpt, seed: int) -> None:
    """Give the tensors megatron-core initialises to constants (norms' ones, biases' zeros)
    distinct values, so a tensor read in another's place changes the logits. A tensor split
    over TP gets each rank's own values, a replicated one the same on every TP rank."""
    import zlib

    stage = parallel_state.get_pipeline_model_parallel_rank()
    rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            if param.dim() != 1:
                continue
            split = getattr(param, "tensor_model_parallel", False)
            key = f"{seed}/{stage}/{rank if split else '-'}/{name}"
            gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            param.add_(0.1 * torch.randn(param.shape, generator=gen))


def _gpt_model(model, config, tp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=model.normalization),
        vocab_size=model.padded_vocab_size(tp),
        max_sequence_length=model.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
        rotary_base=model.rotary_base,
    )


def load_torch_dist(gpt, directory: str) -> None:
    """Every rank: ``gpt``'s weights from the torch_dist checkpoint ``directory`` (an
    ``iter_``/``release`` folder), with megatron-core's own ``dist_checkpointing.load``."""
    from megatron.core import dist_checkpointing

    with cuda_stand_ins():
        state = dist_checkpointing.load({"model": gpt.sharded_state_dict()}, directory)
    gpt.load_state_dict(state["model"])


def run_tool(script: str, *argv: str) -> None:
    """``tools/<script>``'s ``main(argv)`` in this process (a test's rank cannot start the
    session's program server)."""
    import importlib.util

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("tool", os.path.join(repo, "tools", script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([str(a) for a in argv]) == 0


def pipeline_logits(gpt, tokens: torch.Tensor) -> torch.Tensor | None:
    """megatron-core's forward of ``tokens`` ``[b, s]`` through the stages (the hidden states
    sent from each stage to the next); the last stage's ranks return the full-vocabulary
    logits ``[b, s, V_pad]`` (gathered over TP), the others None."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = tokens.shape
    positions = torch.arange(s)[None].expand(b, s)
    if not parallel_state.is_pipeline_first_stage():
        hidden = torch.empty(s, b, gpt.config.hidden_size)
        dist.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
        gpt.set_input_tensor(hidden)
    with torch.no_grad():
        out = gpt(tokens, positions, None)
    if not parallel_state.is_pipeline_last_stage():
        dist.send(out.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    return gather_from_tensor_model_parallel_region(out)


@contextlib.contextmanager
def cuda_stand_ins():
    """What megatron-core's torch_dist writer asks of CUDA, on CPU; and its writer processes
    (a ``Manager`` and forked writers), which a test's rank (a daemonic process) may start
    only while it is not marked daemonic."""
    process = multiprocessing.current_process()
    daemon = process._config.get("daemon")
    process._config["daemon"] = False
    try:
        with (
            mock.patch("torch.cuda.synchronize"),
            mock.patch("torch.cuda.current_device", return_value="cpu"),
        ):
            yield
    finally:
        process._config["daemon"] = daemon


def _iteration_dir(save_dir: str) -> str:
    path = os.path.join(save_dir, f"iter_{ITERATION:07d}")
    os.makedirs(path, exist_ok=True)
    return path


def _publish(save_dir: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    dist.barrier()


def save_torch_dist(gpt, args: argparse.Namespace, save_dir: str) -> None:
    """Every rank: ``gpt`` in Megatron-LM's torch_dist format (collective)."""
    from megatron.core import dist_checkpointing

    state = {
        "model": gpt.sharded_state_dict(),
        "args": args,
        "iteration": ITERATION,
        "checkpoint_version": 3.0,
    }
    directory = _iteration_dir(save_dir)
    with cuda_stand_ins(), _own_results_queue():
        dist_checkpointing.save(state, directory)
    _publish(save_dir)


@contextlib.contextmanager
def _own_results_queue():
    """megatron-core's writer keeps a module-level ``Manager`` queue whose server process it
    never stops (it would outlive every test rank): give it one that stops after the save."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    manager = multiprocessing.get_context("spawn").Manager()
    try:
        queue = manager.Queue()
        with mock.patch.object(filesystem_async, "_get_write_results_queue", lambda: queue):
            yield
    finally:
        manager.shutdown()


def save_legacy(gpt, args: argparse.Namespace, save_dir: str, *, te_names: bool = False) -> None:
    """Every rank: ``gpt``'s ``state_dict`` in Megatron-LM's legacy torch format (collective);
    ``te_names``: under the Transformer Engine spec's names."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    t = parallel_state.get_tensor_model_parallel_rank()
    p = parallel_state.get_pipeline_model_parallel_rank()
    state = {}
    for key, value in gpt.state_dict().items():
        for local, te in TE_NORMS.items() if te_names else ():
            key = key.replace(local, te)
        state[key] = value
    name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
    directory = os.path.join(_iteration_dir(save_dir), name)
    os.makedirs(directory, exist_ok=True)
    record = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": state}
    torch.save(record, os.path.join(directory, "model_optim_rng.pt"))
    assert tp * pp == dist.get_world_size()
    _publish(save_dir)


# Megatron-DeepSpeed: Megatron's legacy model names, as megatron/model/{language_model,
# transformer,gpt_model}.py name them, and DeepSpeed's files (``global_stepN``, ``latest``)
DS_LAYER_NAMES = {
    "self_attention.linear_qkv.": "self_attention.query_key_value.",
    "self_attention.linear_proj.": "self_attention.dense.",
    "pre_mlp_layernorm.": "post_attention_layernorm.",
    "mlp.linear_fc1.": "mlp.dense_h_to_4h.",
    "mlp.linear_fc2.": "mlp.dense_4h_to_h.",
}


def deepspeed_args(model, *, tp: int, pp: int, vocab_size: int) -> argparse.Namespace:
    """The args Megatron-DeepSpeed saves for ``model``, under its own names."""
    args = megatron_args(model, tp=tp, pp=pp, vocab_size=vocab_size)
    for name in ("group_query_attention", "num_query_groups", "position_embedding_type",
                 "rotary_base", "norm_epsilon", "transformer_impl", "spec"):  # fmt: skip
        delattr(args, name)
    rope = model.position_embedding_type == "rope"
    vars(args).update(
        num_key_value_heads=model.num_query_groups or model.num_attention_heads,
        use_rotary_position_embeddings=rope,
        add_position_embedding=not rope,
        rope_theta=model.rotary_base,
        normalization=model.normalization.lower(),
        layernorm_epsilon=model.norm_epsilon,
        num_experts=[1],
        apply_residual_connection_post_layernorm=False,
        deepspeed=True,
    )
    return args


def _legacy_layer_name(rest: str) -> str:
    for ours, theirs in DS_LAYER_NAMES.items():
        if rest.startswith(ours):
            return theirs + rest.removeprefix(ours)
    return rest


def save_deepspeed(gpt, args: argparse.Namespace, save_dir: str) -> None:
    """Every rank: ``gpt`` as Megatron-DeepSpeed saves it through DeepSpeed (collective):
    without pipeline stages the nested ``module`` in ``mp_rank_TT_model_states.pt``; with them
    one ``layer_II-model_TT-model_states.pt`` per layer of ``GPTModelPipe`` (1: embedding,
    2 .. L+1: layers, L+2: final norm, L+3: the untied output layer)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    t = parallel_state.get_tensor_model_parallel_rank()
    p = parallel_state.get_pipeline_model_parallel_rank()
    layers, per = args.num_layers, args.num_layers // pp
    directory = os.path.join(save_dir, f"global_step{ITERATION}")
    os.makedirs(directory, exist_ok=True)
    files: dict[int, dict] = {}
    module = {"language_model": {"embedding": {}, "encoder": {}}}
    lm = module["language_model"]
    for key, value in gpt.state_dict().items():
        if "_extra_state" in key:
            continue
        if key.startswith("embedding."):
            part, _, leaf = key.removeprefix("embedding.").partition(".")
            lm["embedding"].setdefault(part, {})[leaf] = value
            files.setdefault(1, {})[f"{part}.{leaf}"] = value
        elif key.startswith("decoder.layers."):
            local, _, rest = key.removeprefix("decoder.layers.").partition(".")
            i, rest = p * per + int(local), _legacy_layer_name(rest)
            lm["encoder"][f"layers.{i}.{rest}"] = value
            files.setdefault(2 + i, {})[rest] = value
        elif key.startswith("decoder.final_layernorm."):
            leaf = key.removeprefix("decoder.final_layernorm.")
            lm["encoder"][f"final_layernorm.{leaf}"] = value
            files.setdefault(layers + 2, {})[leaf] = value
        elif key == "output_layer.weight" and args.untie_embeddings_and_output_weights:
            lm["output_layer"] = {"weight": value}
            files.setdefault(layers + 3, {})["lm_head.weight"] = value
    if pp > 1:
        for index, state in files.items():
            torch.save(
                state, os.path.join(directory, f"layer_{index:02d}-model_{t:02d}-model_states.pt")
            )
    if p == 0:
        record = {"module": module if pp == 1 else None, "args": args, "iteration": ITERATION,
                  "checkpoint_version": 3.0, "dp_world_size": 1, "mp_world_size": tp}  # fmt: skip
        torch.save(record, os.path.join(directory, f"mp_rank_{t:02d}_model_states.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, "latest"), "w") as f:
            f.write(f"global_step{ITERATION}")
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    dist.barrier()
