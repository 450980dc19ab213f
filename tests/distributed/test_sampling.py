"""Vocabulary-parallel token choice (greedy, top-k, top-p, Gumbel-max sampling) against dense
references written here, at TP = 1 and 2 (padding and uneven true columns included); a choice
makes no host synchronisation."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import device_rules
from tests.helpers.distributed import run_distributed

VOCAB, PADDED = 45, 48  # TP 2: rank 0 holds 24 true columns, rank 1 holds 21 + 3 padded


def _logits(batch: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    full = torch.randn(batch, PADDED, generator=g) * 2
    full[:, VOCAB:] = 1e4  # padding must never be chosen
    return full


def dense_top_k(scaled: torch.Tensor, k: int) -> torch.Tensor:
    kth = scaled.topk(k, dim=-1).values[:, -1:]
    return scaled >= kth


def dense_top_p(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens until their mass reaches top_p (sorting, float64)."""
    probs = scaled.double().softmax(-1)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    for row in range(probs.shape[0]):
        order = probs[row].argsort(descending=True)
        mass = 0.0
        for i in order.tolist():
            keep[row, i] = True
            mass += probs[row, i].item()
            if mass >= top_p:
                break
    return keep


def _choose(tp: int, config: dict, draws: int, tau: list[float]):
    from megatron_tempnet.distributed.groups import TPGroup
    from megatron_tempnet.inference.token_sampling import SamplingConfig, TokenChooser

    group = torch.distributed.new_group(list(range(tp)))
    rank = torch.distributed.get_rank()
    part = PADDED // tp
    local = _logits()[:, rank * part : (rank + 1) * part]
    chooser = TokenChooser(SamplingConfig(**config), VOCAB, TPGroup(group, rank, tp), part)
    tau_t = torch.tensor(tau)
    kept = None
    if config.get("top_k") or config.get("top_p", 1.0) < 1.0:
        scaled = local[:, : chooser.part.n_true] / tau_t[:, None]
        if config.get("top_k"):
            scaled = chooser._top_k(scaled, config["top_k"])
        if config.get("top_p", 1.0) < 1.0:
            scaled = chooser._top_p(scaled, config["top_p"])
        kept = torch.isfinite(scaled)
        kept = chooser.tp.all_gather(
            torch.nn.functional.pad(kept, (0, part - kept.shape[1])), dim=1
        )[:, :VOCAB]  # test only: gather the mask to compare with the dense reference
    counter, before = device_rules.counter(), len(device_rules.counter().events)
    chosen = torch.stack([chooser.choose(local, tau_t) for _ in range(draws)])
    # choosing waits for nothing: the noise is drawn on the logits' device
    assert counter.events[before:] == [], counter.events[before:]
    return chosen, kept


TAU = [0.5, 1.0, 2.0]


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_top_k_top_p_match_dense_references(tp):
    scaled = _logits()[:, :VOCAB] / torch.tensor(TAU)[:, None]
    greedy, _ = run_distributed(_choose, world_size=tp, args=(tp, {"greedy": True}, 1, TAU))[0]
    assert torch.equal(greedy[0], scaled.argmax(-1))
    for config, want in [
        ({"greedy": False, "top_k": 5}, dense_top_k(scaled, 5)),
        ({"greedy": False, "top_p": 0.6}, dense_top_p(scaled, 0.6)),
        (
            {"greedy": False, "top_k": 10, "top_p": 0.8},
            dense_top_p(scaled.masked_fill(~dense_top_k(scaled, 10), -torch.inf), 0.8),
        ),
    ]:
        results = run_distributed(_choose, world_size=tp, args=(tp, config, 50, TAU))
        samples, kept = results[0]
        assert torch.equal(kept, want), config
        assert kept.sum(-1).min() >= 1
        assert bool(want.gather(1, samples.t()).all()), "a sample outside the kept set"
        for other in results[1:]:
            assert torch.equal(other[0], samples)  # every rank chose the same tokens


def test_samples_do_not_depend_on_tp_and_follow_softmax_of_logits_over_tau():
    config = {"greedy": False, "seed": 7}
    one, _ = run_distributed(_choose, world_size=1, args=(1, config, 3000, TAU))[0]
    two, _ = run_distributed(_choose, world_size=2, args=(2, config, 3000, TAU))[0]
    assert torch.equal(one, two)
    probs = _logits()[:, :VOCAB].double() / torch.tensor(TAU, dtype=torch.double)[:, None]
    probs = probs.softmax(-1)
    for row in range(3):
        freq = torch.bincount(one[:, row], minlength=VOCAB).double() / one.shape[0]
        assert (freq - probs[row]).abs().max() < 0.035, row  # ~4 standard errors at 3000 draws
    assert one.max() < VOCAB


def _processor_steps(directory: str, steps: list[torch.Tensor]):
    from megatron_tempnet.inference.hf import TempNetLogitsProcessor

    processor = TempNetLogitsProcessor(directory)
    counter, before = device_rules.counter(), len(device_rules.counter().events)
    scaled = [processor(None, scores.clone()) for scores in steps]
    # a step waits for nothing on the host; reading the recorded taus copies them once
    assert counter.events[before:] == [], counter.events[before:]
    return scaled, processor.taus


def test_the_hf_logits_processor_waits_for_nothing_and_divides_by_tempnets_tau(tmp_path):
    """TempNetLogitsProcessor under the GPU's rules: no host synchronisation per step; its taus
    are the float64 reference TempNet's of each row (an earlier processor's -inf read as the
    row's lowest finite score) and every score is divided by its row's tau."""
    from megatron_tempnet.tempnet import TempNetLM
    from megatron_tempnet.tempnet.export import export_tempnet
    from tests.e2e.test_inference_tools import reference_tau

    torch.manual_seed(0)
    net = TempNetLM(40, hidden_size=8, proj_size=4, padded_vocab_size=48, tau_max=2.0)
    export_tempnet(net.state_dict(), str(tmp_path), tau_min=net.tau_min, tau_max=net.tau_max)
    gen = torch.Generator().manual_seed(3)
    steps = [torch.randn(2, 48, generator=gen) * 3 for _ in range(4)]
    steps[2][0, 5] = -torch.inf  # forbidden by an earlier processor
    scaled, taus = run_distributed(_processor_steps, world_size=1, args=(str(tmp_path), steps))[0]
    assert taus.shape == (2, 4) and taus.device.type == "cpu"
    for t, scores in enumerate(steps):
        rows = [row.masked_fill(row == -torch.inf, row[row.isfinite()].min()) for row in scores]
        want = reference_tau(torch.stack(rows), str(tmp_path))
        torch.testing.assert_close(taus[:, t].double(), want, rtol=0, atol=1e-6)
        torch.testing.assert_close(scaled[t], scores / taus[:, t, None], rtol=1e-6, atol=0)
    assert float(taus.std()) > 0
