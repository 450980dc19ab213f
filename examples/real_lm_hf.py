"""The reference side of ``examples/real_lm.py``: the same GGUF file read by ``transformers``
(which dequantises it with the ``gguf`` package), independent of this project's import.

    python examples/real_lm_hf.py parity --gguf FILE --tokenizer DIR --texts T.jsonl \
        --ours SCORES.jsonl --output parity.json
    python examples/real_lm_hf.py generate --gguf FILE --tempnet EXPORTED --prompts P.txt \
        --output hf_generations.jsonl

``parity``: tokenises each text with the imported checkpoint's tokenizer files (``--tokenizer``,
through ``transformers.AutoTokenizer``), checks that the ids are the ones ``tools/evaluate.py``
scored (``--ours``, its ``--per-token-output``), and compares every token's cross-entropy with
``transformers``' own forward pass. ``generate``: samples from each prompt with plain
``model.generate`` and ``TempNetLogitsProcessor`` (an exported TempNet), printing each token's tau.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch


def _load(gguf: str):
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval()


def parity(args) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    model = _load(args.gguf)
    with open(args.texts) as f:
        texts = [json.loads(line)["text"] for line in f]
    with open(args.ours) as f:
        ours = [json.loads(line) for line in f]
    window = model.config.max_position_embeddings  # tools/evaluate.py's default windows
    ce_ours, ce_hf, worst = [], [], 0.0
    for text, row in zip(texts, ours, strict=True):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if ids[1:] != row["targets"]:
            raise SystemExit(f"the tokens differ from tools/evaluate.py's for {text[:60]!r}...")
        parts = []
        for start in range(0, len(ids) - 1, window):  # each window on its own
            piece = ids[start : start + window + 1]
            with torch.no_grad():
                logits = model(torch.tensor([piece[:-1]])).logits[0].double()  # [s, V]
            target = torch.tensor(piece[1:])
            parts.append(-logits.log_softmax(-1).gather(1, target[:, None])[:, 0])
        ce = torch.cat(parts)
        mine = torch.tensor(row["ce"], dtype=torch.float64)
        worst = max(worst, (ce - mine).abs().max().item())
        ce_hf += ce.tolist()
        ce_ours += mine.tolist()
    return {
        "tokens": len(ce_hf),
        "ppl_ours": math.exp(sum(ce_ours) / len(ce_ours)),
        "ppl_transformers": math.exp(sum(ce_hf) / len(ce_hf)),
        "max_abs_ce_difference": worst,
    }


def generate(args) -> list[dict]:
    from transformers import AutoTokenizer, LogitsProcessorList

    from megatron_tempnet.inference.hf import TempNetLogitsProcessor

    directory, name = os.path.split(os.path.abspath(args.gguf))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = _load(args.gguf)
    processor = TempNetLogitsProcessor(args.tempnet)
    with open(args.prompts) as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    records = []
    for index, prompt in enumerate(prompts):
        processor.reset()
        torch.manual_seed(args.seed + index)
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            logits_processor=LogitsProcessorList([processor]),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.max_new_tokens,
            pad_token_id=tokenizer.eos_token_id,
        )
        new = out[0, ids.shape[1] :].tolist()
        records.append(
            {
                "index": index,
                "prompt": prompt,
                "response": tokenizer.decode(new),
                "tau": processor.taus[0].tolist(),
            }
        )
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("parity")
    a.add_argument("--tokenizer", required=True)
    a.add_argument("--texts", required=True)
    a.add_argument("--ours", required=True)
    b = sub.add_parser("generate")
    b.add_argument("--tempnet", required=True)
    b.add_argument("--prompts", required=True)
    b.add_argument("--max-new-tokens", type=int, default=40)
    b.add_argument("--seed", type=int, default=1)
    for s in (a, b):
        s.add_argument("--gguf", required=True)
        s.add_argument("--output", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(max(os.cpu_count() or 1, 1))
    if args.command == "parity":
        text = json.dumps(parity(args), indent=2) + "\n"
    else:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in generate(args))
    with open(args.output, "w") as f:
        f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
