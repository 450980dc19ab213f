"""Generation benchmark: our engine (KV cache, batches) against Hugging Face ``generate``.

A randomly initialised LLaMA-shaped model (default: 12 layers, width 640, 10 heads, SwiGLU 1728,
vocabulary 32000: 100.3M parameters) is written as a Hugging Face directory, converted with
``tools/checkpoint/convert_hf_to_megatron.py``, and given one random TempNet (exported as
``tools/export_tempnet.py`` writes it). Both sides run the same weights in float32 in this
process, greedy, every sequence generating exactly ``--new-tokens`` tokens (no end-of-document
stop), with TempNet's tau on every step:

1. tokens per second, ours (``megatron_tempnet.inference.generation.generate``) against HF
   ``model.generate`` with ``TempNetLogitsProcessor`` (SDPA attention, its dynamic KV cache), per
   ``--batch-sizes`` (prompts of ``--prompt-length`` random tokens; HF batches are left-padded
   with an attention mask, ours right-padded; here all prompts are equally long). The two take
   turns, ``--repeats`` times; the median. Also whether the greedy tokens are the same.
2. cost per token along the length: ours and HF's at batch 1 for ``--long-tokens`` new tokens,
   the mean time per new token over tokens 1-64 and over the last 64.
3. the recompute path (``kv_cache=False``: the whole sequence every step, the algorithm before
   the KV cache) at batch 1, for the record.

    python benchmarks/generate_bench.py --json benchmarks/results/generate_bench_cpu.json
    python benchmarks/generate_bench.py --device cuda --num-layers 32 --hidden-size 4096 ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=640)
    p.add_argument("--num-attention-heads", type=int, default=10)
    p.add_argument("--ffn-hidden-size", type=int, default=1728)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--tempnet-size", type=int, default=256)
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--long-tokens", type=int, default=512)
    p.add_argument("--recompute-tokens", type=int, default=256)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def build(args, directory: str):
    """(our InferenceModel, the HF model, the exported TempNet's directory)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_tempnet.inference.model import init_inference, load_inference_model
    from megatron_tempnet.tempnet import TempNetLM
    from megatron_tempnet.tempnet.export import export_tempnet

    positions = args.prompt_length + max(args.new_tokens, args.long_tokens, args.recompute_tokens)
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.ffn_hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_attention_heads,
        max_position_embeddings=positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config)
    hf_dir = os.path.join(directory, "hf")
    hf.save_pretrained(hf_dir)
    ckpt = os.path.join(directory, "ckpt")
    convert = [sys.executable, os.path.join(REPO, "tools", "checkpoint",
               "convert_hf_to_megatron.py"), "--hf-dir", hf_dir, "--save", ckpt]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO)
    result = subprocess.run(convert, env=env, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    tempnet = TempNetLM(args.vocab_size, hidden_size=args.tempnet_size, proj_size=args.tempnet_size)
    tempnet_dir = os.path.join(directory, "tempnet")
    export_tempnet(tempnet.state_dict(), tempnet_dir, tau_min=tempnet.tau_min,
                   tau_max=tempnet.tau_max)  # fmt: skip
    init_inference(1)
    ours = load_inference_model(ckpt, tempnet_dir=tempnet_dir)
    hf = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa").eval()
    if args.device == "cuda":
        hf.cuda()
    return ours, hf, tempnet_dir


class Steps:
    """Wall-clock time of every step (``on_step`` for ours, a logits processor for HF)."""

    def __init__(self):
        self.times = []

    def start(self):
        self.times = [_now()]

    def __call__(self, *args):
        self.times.append(_now())
        return args[1] if len(args) == 2 else None  # as a logits processor: the scores

    def per_token(self, first: int, last: int) -> float:
        """Mean seconds per new token over tokens ``first..last`` (1-based)."""
        return (self.times[last] - self.times[first - 1]) / (last - first + 1)


def _now() -> float:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def ours_generate(model, prompts, new: int, steps=None, kv_cache: bool = True):
    from megatron_tempnet.inference.generation import generate
    from megatron_tempnet.inference.token_sampling import SamplingConfig

    if steps is not None:
        steps.start()
    out = generate(model, prompts, max_new_tokens=new, sampling=SamplingConfig(greedy=True),
                   micro_batch_size=len(prompts), kv_cache=kv_cache,
                   on_step=steps)  # fmt: skip
    return [o.token_ids for o in out]


def hf_generate(hf, tempnet_dir: str, prompts, new: int, steps=None):
    import torch
    from transformers import LogitsProcessorList

    from megatron_tempnet.inference.hf import TempNetLogitsProcessor

    device = next(hf.parameters()).device
    ids = torch.tensor(prompts, device=device)
    processors = [TempNetLogitsProcessor(tempnet_dir, record=False)]
    if steps is not None:
        steps.start()
        processors.append(steps)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False,
                          logits_processor=LogitsProcessorList(processors),
                          pad_token_id=0)  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


def timed(fn, *a, **kw):
    start = _now()
    result = fn(*a, **kw)
    return _now() - start, result


def main(argv=None) -> int:
    import torch

    warnings.filterwarnings("ignore")
    args = parse_args(argv)
    sys.path.insert(0, REPO)
    with tempfile.TemporaryDirectory() as directory:
        ours, hf, tempnet_dir = build(args, directory)
        params = sum(p.numel() for p in hf.parameters())
        print(f"# {common.machine(args.device)}; LLaMA-shaped, {params / 1e6:.1f}M parameters, "
              f"float32, torch threads {torch.get_num_threads()}")  # fmt: skip
        g = torch.Generator().manual_seed(1)
        rows = []
        print("| batch | new tokens | ours tok/s | HF tok/s | ours / HF | same tokens |")
        print("|---|---|---|---|---|---|")
        for b in map(int, args.batch_sizes.split(",")):
            prompts = torch.randint(3, args.vocab_size, (b, args.prompt_length), generator=g)
            prompts = prompts.tolist()
            ours_generate(ours, prompts, 4)  # warm-up (compilation of the fusions)
            hf_generate(hf, tempnet_dir, prompts, 4)
            ours_t, hf_t = [], []
            for _ in range(args.repeats):
                t, ours_tokens = timed(ours_generate, ours, prompts, args.new_tokens)
                ours_t.append(t)
                t, hf_tokens = timed(hf_generate, hf, tempnet_dir, prompts, args.new_tokens)
                hf_t.append(t)
            n = b * args.new_tokens
            row = {
                "batch": b,
                "new_tokens": args.new_tokens,
                "ours_tok_s": n / statistics.median(ours_t),
                "hf_tok_s": n / statistics.median(hf_t),
                "same_tokens": ours_tokens == hf_tokens,
                "ours_s": ours_t,
                "hf_s": hf_t,
            }
            row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
            rows.append(row)
            print(f"| {b} | {args.new_tokens} | {row['ours_tok_s']:.1f} | {row['hf_tok_s']:.1f} "
                  f"| {row['ratio']:.2f}x | {row['same_tokens']} |", flush=True)  # fmt: skip

        prompt = [torch.randint(3, args.vocab_size, (args.prompt_length,), generator=g).tolist()]
        n, w = args.long_tokens, 64
        print(f"\n| engine, batch 1 | ms/token, tokens 1-{w} | ms/token, tokens {n - w + 1}-{n} "
              "| ratio |")  # fmt: skip
        print("|---|---|---|---|")
        flat = {}
        for name, run in (
            ("ours", lambda s: ours_generate(ours, prompt, n, s)),
            ("HF", lambda s: hf_generate(hf, tempnet_dir, prompt, n, s)),
        ):
            steps = Steps()
            run(steps)
            early, late = steps.per_token(1, w), steps.per_token(n - w + 1, n)
            flat[name] = {"early_ms": early * 1e3, "late_ms": late * 1e3, "ratio": late / early}
            print(f"| {name} | {early * 1e3:.2f} | {late * 1e3:.2f} | {late / early:.2f} |",
                  flush=True)  # fmt: skip

        r = args.recompute_tokens
        t_cache, cached = timed(ours_generate, ours, prompt, r)
        t_recompute, recomputed = timed(ours_generate, ours, prompt, r, kv_cache=False)
        recompute = {
            "new_tokens": r,
            "cached_tok_s": r / t_cache,
            "recompute_tok_s": r / t_recompute,
            "same_tokens": cached == recomputed,
        }
        print(f"\n| batch 1, {r} new tokens | tok/s | same tokens |\n|---|---|---|\n"
              f"| KV cache | {r / t_cache:.1f} | |\n"
              f"| recompute (before the cache) | {r / t_recompute:.1f} | "
              f"{recompute['same_tokens']} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": common.machine(args.device), "args": vars(args),
                       "parameters": params, "speed": rows, "flat": flat,
                       "recompute": recompute}, f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
