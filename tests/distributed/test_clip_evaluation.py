"""Zero-shot evaluation over data-parallel ranks: every rank encodes its share, the gathered
embeddings are in dataset order, and the metrics (retrieval, zero-shot, tau statistics, the
temperature's OOD AUROC) equal references computed here on the whole set in one process."""

from __future__ import annotations

import pytest
import torch
from sklearn.metrics import roc_auc_score

from tests.helpers.distributed import run_distributed

NAMES = ("zero", "one", "two")


class PairSet:
    """``n`` pairs whose 'image' is a seeded random vector (the fake engine reads it)."""

    def __init__(self, n: int, seed: int, shift: float = 0.0):
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.randn(n, 4, generator=gen) + shift
        self.labels = [NAMES[i % 3] for i in range(n)]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {
            "image": self.images[i],
            "tokens": torch.full((3,), i % 3),
            "length": torch.tensor(3),
            "index": torch.tensor(i),
            "label": self.labels[i],
        }

    def label(self, i):
        return self.labels[i]


class FakeEngine:
    """``CLIPTrainModule.encode`` in miniature: embeddings and a tau from the inputs."""

    def eval(self):
        pass

    def train(self):
        pass

    def __call__(self, images, tokens, lengths, encode=False):
        out = {}
        if images is not None:
            out["image"] = torch.nn.functional.normalize(images, dim=1)
            out["image_tau"] = 0.01 + 0.01 * torch.sigmoid(images.sum(dim=1))
        text = torch.nn.functional.one_hot(tokens[:, 0], 4).float() + 0.1
        out["text"] = torch.nn.functional.normalize(text, dim=1)
        out["text_tau"] = 0.02 + 0.001 * tokens[:, 0].float()
        return out


def _evaluate():
    import torch.distributed as dist

    from megatron_tempnet.models.clip.evaluation import evaluate_clip

    def encode_texts(texts):
        ids = torch.tensor([NAMES.index(t.split()[-1]) for t in texts])[:, None].expand(-1, 3)
        return FakeEngine()(None, ids, None)["text"].cpu()  # on the host, as the task's

    return evaluate_clip(
        FakeEngine(),
        PairSet(23, 0),
        batch_size=4,
        dp_group=dist.group.WORLD,
        encode_texts=encode_texts,
        templates=["a {}", "the digit {}"],
        ood_ds=PairSet(11, 1, shift=1.0),
    )


def _reference() -> dict:
    from megatron_tempnet.models.clip.zero_shot_metrics import retrieval_recalls

    valid, ood, engine = PairSet(23, 0), PairSet(11, 1, shift=1.0), FakeEngine()
    enc = engine(valid.images, torch.tensor([[i % 3] * 3 for i in range(23)]), None)
    enc_ood = engine(ood.images, torch.tensor([[i % 3] * 3 for i in range(11)]), None)
    ref = {
        f"val_{k}": v
        for k, v in retrieval_recalls(
            enc["image"], enc["text"], image_keys=valid.labels, text_keys=valid.labels
        ).items()
    }
    classes = enc["text"][:3]  # each class's prompts all encode like its caption
    predicted = (enc["image"] @ classes.t()).argmax(dim=1)
    ref["val_zeroshot_top1"] = 100.0 * float((predicted == torch.arange(23) % 3).float().mean())
    for side in ("image", "text"):
        scores = torch.cat([enc[f"{side}_tau"], enc_ood[f"{side}_tau"]]).numpy()
        ref[f"val_ood_auroc_{side}"] = roc_auc_score([0] * 23 + [1] * 11, scores)
    ref["val_tau_image_mean"] = float(enc["image_tau"].mean())
    return ref


@pytest.mark.parametrize("world", [1, 2, 3])
def test_evaluation_over_ranks_equals_one_process_reference(world):
    ref = _reference()
    for got in run_distributed(_evaluate, world):
        for key, value in ref.items():
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
