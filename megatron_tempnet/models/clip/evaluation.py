"""Zero-shot evaluation of a CLIP model in training: retrieval, classification, tau, OOD AUROC.

Every data-parallel rank encodes every ``dp``-th sample of an evaluation set (all tensor-parallel
ranks of a group the same ones), and the embeddings are all-gathered into dataset order, so
every rank computes the same metrics:

- retrieval: IR@1/5/10 and TR@1/5/10 (``zero_shot_metrics.retrieval_recalls``); with labels, a
  retrieved item is correct when it carries the query's label (COCO: the image id; a class
  name for datasets whose captions describe the class only);
- zero-shot classification with prompt templates over the labels as class names (top-1/top-5);
- the predicted temperatures' statistics (``clip``, ``tau``, ``tempnet``);
- with an out-of-distribution set, the AUROC of the temperature as an uncertainty score (OOD =
  positive; TaU: its score ``-a``, TempNet: tau), for images and for texts (TaU's experiment).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_tempnet.models.clip.data.image_text import ImageTextDataError
from megatron_tempnet.models.clip.step import unpack_batch
from megatron_tempnet.models.clip.zero_shot_metrics import (
    auroc,
    class_embeddings,
    retrieval_recalls,
    tau_statistics,
    zero_shot_accuracy,
)


def _gather_rows(local: torch.Tensor, total: int, group) -> torch.Tensor:
    """Rows ``rank::world`` from every rank (on the device) -> ``[total, ...]`` in dataset
    order, on the host."""
    world = dist.get_world_size(group)
    if world == 1:
        return local.cpu()
    per_rank = math.ceil(total / world)
    padded = local.new_zeros((per_rank, *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.stack(parts, dim=1).reshape(per_rank * world, *local.shape[1:])[:total].cpu()


@torch.no_grad()
def encode_dataset(engine, dataset, batch_size: int, dp_group) -> dict:
    """Every sample's outputs of ``CLIPTrainModule.encode`` (``[N, ...]``) plus ``labels``."""
    rank, world = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    if len(dataset) < world:
        raise ImageTextDataError(
            f"an evaluation set of {len(dataset)} samples cannot be split over {world} "
            "data-parallel ranks: give a larger --valid-data/--ood-data set"
        )
    mine = list(range(rank, len(dataset), world))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(dataset, mine), batch_size=batch_size, shuffle=False
    )
    engine.eval()
    parts: dict[str, list] = {}
    for batch in loader:
        images, tokens, lengths, _ = unpack_batch(batch)
        for key, value in engine(images, tokens, lengths, encode=True).items():
            parts.setdefault(key, []).append(value.float())  # on the device until gathered
    engine.train()
    out = {key: _gather_rows(torch.cat(v), len(dataset), dp_group) for key, v in parts.items()}
    out["labels"] = [dataset.label(i) for i in range(len(dataset))]
    return out


def evaluate_clip(
    engine,
    valid_ds,
    *,
    batch_size: int,
    dp_group,
    encode_texts=None,
    templates: list[str] | None = None,
    ood_ds=None,
) -> dict:
    """The metrics above, as a flat dict (``val_ir@1``, ..., ``val_zeroshot_top1``, ...)."""
    enc = encode_dataset(engine, valid_ds, batch_size, dp_group)
    labels = enc["labels"]
    keys = labels if all(labels) else None
    metrics = retrieval_recalls(enc["image"], enc["text"], image_keys=keys, text_keys=keys)
    if templates and all(labels) and encode_texts is not None:
        names = sorted(set(labels))
        classes = class_embeddings(encode_texts, names, templates)
        targets = torch.tensor([names.index(label) for label in labels])
        zero_shot = zero_shot_accuracy(enc["image"], classes, targets)
        metrics.update({f"zeroshot_{k}": v for k, v in zero_shot.items()})
    for side in ("image", "text"):
        if f"{side}_tau" in enc:
            metrics.update(tau_statistics(enc[f"{side}_tau"], prefix=f"tau_{side}"))
    if ood_ds is not None and "image_tau" in enc:
        ood = encode_dataset(engine, ood_ds, batch_size, dp_group)
        for side in ("image", "text"):
            score = f"{side}_score" if f"{side}_score" in enc else f"{side}_tau"
            scores = torch.cat([enc[score], ood[score]])
            is_ood = [False] * len(enc[score]) + [True] * len(ood[score])
            metrics[f"ood_auroc_{side}"] = auroc(scores, is_ood)
    return {f"val_{k}": v for k, v in metrics.items()}
