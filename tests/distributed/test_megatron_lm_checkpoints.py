"""Megatron-LM's checkpoints load here at another layout: megatron-core's own ``GPTModel`` (GPT-2
and LLaMA shapes) saved at TP 2 and at TP 1 x PP 2 in Megatron-LM's torch_dist and legacy torch
formats (``tests.helpers.megatron_lm``) gives, loaded here at TP 1 and TP 2, megatron-core's
own logits."""

from __future__ import annotations

import os

import pytest
import torch
from megatron.core import parallel_state

from tests.helpers.distributed import run_distributed
from tests.helpers.shapes import parity_model

SEQ, VOCAB = 16, 100
IDS = VOCAB + 1  # NullTokenizer's ids: 0 .. VOCAB, VOCAB the end of document


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
    out = {f: _ours(os.path.join(root, f), read_tp) for f in ("dist", "legacy")}
    out["reference"] = None if reference is None else reference[..., :IDS]
    return out


@pytest.mark.parametrize(
    ("arch", "tp", "pp", "read_tp"), [("llama", 2, 1, 1), ("gpt2", 1, 2, 2)], ids=["tp2", "pp2"]
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
        for fmt in ("dist", "legacy"):
            torch.testing.assert_close(rank[fmt], reference, rtol=1e-5, atol=1e-5)
