"""Megatron-LM's checkpoints load here at another layout: megatron-core's own ``GPTModel`` (GPT-2
and LLaMA shapes) saved at TP 2 and at TP 1 x PP 2 in Megatron-LM's torch_dist and legacy torch
formats and in Megatron-DeepSpeed's (DeepSpeed's files, Megatron's legacy names; at PP 2 one
file per layer) (``tests.helpers.megatron_lm``) gives, loaded here at TP 1 and TP 2, megatron-core's
own logits; written back in torch_dist (tools/checkpoint/export_megatron_lm.py, from this
project's format), megatron-core's ``dist_checkpointing.load`` gives a fresh ``GPTModel`` the
same weights."""

from __future__ import annotations

import os

import pytest
import torch
from megatron.core import parallel_state

from tests.helpers.distributed import run_distributed
from tests.helpers.shapes import parity_model

SEQ, VOCAB = 16, 100
IDS = VOCAB + 1  # NullTokenizer's ids: 0 .. VOCAB, VOCAB the end of document
FORMATS = ("dist", "legacy", "deepspeed")  # torch_dist, torch, Megatron-DeepSpeed's


def _tokens():
    gen = torch.Generator().manual_seed(5)
    return torch.randint(0, IDS, (2, SEQ), generator=gen)


def _ours(load_dir: str, tp: int) -> torch.Tensor:
    """This project's inference model of ``load_dir`` at TP ``tp``: full logits ``[b, s, IDS]``."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_tempnet.inference.model import load_inference_model

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = load_inference_model(load_dir)
    return gather_from_tensor_model_parallel_region(model.logits(_tokens()))[..., :IDS]


def _write_then_read(root: str, arch: str, tp: int, pp: int, read_tp: int) -> dict:
    from tests.helpers import megatron_lm

    model = parity_model(arch, SEQ, IDS, llama_ffn=96)
    gpt = megatron_lm.build_gpt_model(model, tp=tp, pp=pp)
    reference = megatron_lm.pipeline_logits(gpt, _tokens())
    args = megatron_lm.megatron_args(model, tp=tp, pp=pp, vocab_size=VOCAB)
    megatron_lm.save_torch_dist(gpt, args, os.path.join(root, "dist"))
    megatron_lm.save_legacy(gpt, args, os.path.join(root, "legacy"), te_names=arch == "llama")
    ds_args = megatron_lm.deepspeed_args(model, tp=tp, pp=pp, vocab_size=VOCAB)
    megatron_lm.save_deepspeed(gpt, ds_args, os.path.join(root, "deepspeed"))
    out = {f: _ours(os.path.join(root, f), read_tp) for f in FORMATS}
    out["reference"] = None if reference is None else reference[..., :IDS]
    out["exported"] = _export_and_reload(root, gpt, model, tp, pp)
    return out


def _export_and_reload(root: str, gpt, model, tp: int, pp: int) -> dict[str, bool]:
    """Megatron-LM -> this project's format -> Megatron-LM torch_dist at the writer's layout,
    loaded into a fresh ``GPTModel`` (another seed): each of its tensors equals ``gpt``'s."""
    import torch.distributed as dist

    from megatron_tempnet.inference.checkpoint_io import open_reader, write_checkpoint
    from tests.helpers import megatron_lm

    ours, back = os.path.join(root, "ours"), os.path.join(root, "back")
    if dist.get_rank() == 0:
        reader = open_reader(os.path.join(root, "legacy"))
        write_checkpoint(ours, reader.model, reader.full)
        megatron_lm.run_tool(
            "checkpoint/export_megatron_lm.py", "--load", ours, "--save", back,
            "--target-tp", tp, "--target-pp", pp,
        )  # fmt: skip
    dist.barrier()
    fresh = megatron_lm.build_gpt_model(model, tp=tp, pp=pp, seed=99)
    megatron_lm.load_torch_dist(fresh, os.path.join(back, "release"))
    want = {k: v for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)}
    got = fresh.state_dict()
    assert want.keys() <= got.keys()
    same = {}
    for k, v in want.items():
        if k.endswith(("word_embeddings.weight", "output_layer.weight")):
            # this rank's rows of the padded vocabulary: the true ones equal, the padding zero
            start = parallel_state.get_tensor_model_parallel_rank() * v.shape[0]
            true = max(0, min(v.shape[0], IDS - start))
            same[k] = torch.equal(got[k][:true], v[:true]) and not got[k][true:].any()
        else:
            same[k] = torch.equal(got[k], v)
    return same


@pytest.mark.parametrize(
    ("arch", "tp", "pp", "read_tp"),
    [("llama", 2, 1, 1), ("gpt2", 1, 2, 2), ("gpt2", 2, 1, 1), ("llama", 1, 2, 2)],
    ids=["llama-tp2", "gpt2-pp2", "gpt2-tp2", "llama-pp2"],
)
def test_megatron_lm_checkpoints_give_megatron_cores_logits_at_another_layout(
    tmp_path, arch, tp, pp, read_tp
):
    results = run_distributed(
        _write_then_read, world_size=2, args=(str(tmp_path), arch, tp, pp, read_tp)
    )
    reference = results[-1]["reference"]
    assert reference is not None and reference.shape == (2, SEQ, IDS)
    for rank in results:
        assert rank["exported"] and all(rank["exported"].values()), rank["exported"]
        for fmt in FORMATS:
            torch.testing.assert_close(rank[fmt], reference, rtol=1e-5, atol=1e-5)
