"""Wrong data stops pretrain_gpt.py and tools/evaluate.py at start-up with one line per process:
a dataset tokenised with another tokenizer (same type and size, other files), and a dataset
holding an id outside the vocabulary (at TP 2, where megatron-core's vocabulary-parallel
embedding would otherwise train on it without a word)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from megatron_tempnet.data.indexed import IndexedDatasetWriter
from megatron_tempnet.data.preprocess import PreprocessConfig, run_preprocess
from megatron_tempnet.data.tokenizers import build_tokenizer
from tests.helpers.corpus import data_flags, pydoc_documents, train_gpt2_bpe, write_jsonl
from tests.helpers.entry_points import Running, cli_flags, run_command, run_entry_point
from tests.helpers.run_flags import ONE_LAYER, tempnet_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 512  # = the padded vocabulary at TP 1 and 2: an id past it has no embedding row at all
BAD_ID, BAD_AT = VOCAB + 5, 777


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The run's tokenizer and its dataset; a dataset of another GPT-2 BPE (trained on
    upper-cased text: same type, same size, other files); the run's dataset with one id past the
    vocabulary, written as a tool without tokenizer records would."""
    d = tmp_path_factory.mktemp("wrong_data")
    (d / "other").mkdir()
    vocab, merges = train_gpt2_bpe(str(d), VOCAB)
    other = train_gpt2_bpe(str(d / "other"), VOCAB, [t.upper() for t in pydoc_documents()])
    docs = write_jsonl(str(d / "docs.jsonl"), [{"text": t} for t in pydoc_documents(60)])
    gpt2 = {"tokenizer_type": "GPT2BPETokenizer"}
    specs = {
        "run": {**gpt2, "vocab_file": vocab, "merge_file": merges},
        "other": {**gpt2, "vocab_file": other[0], "merge_file": other[1]},
    }
    prefixes = {}
    for name, spec in specs.items():
        config = PreprocessConfig([docs], str(d / name), spec, append_eod=True)
        prefixes[name] = run_preprocess(config)[0].prefix
    tokens = np.fromfile(prefixes["run"] + ".bin", dtype=np.uint16)
    tokens = tokens[: tokens.size // 100 * 100]
    tokens[BAD_AT] = BAD_ID
    prefixes["bad_id"] = str(d / "bad_id")
    with IndexedDatasetWriter(prefixes["bad_id"], np.uint16) as w:
        w.add_documents(tokens, np.full(tokens.size // 100, 100))  # 100-token documents
    identities = {name: build_tokenizer(**spec).identity for name, spec in specs.items()}
    assert identities["run"].vocab_size == identities["other"].vocab_size == VOCAB
    return {"dir": d, "spec": specs["run"], "prefix": prefixes, "identity": identities}


def _args(data, tmp, **flags) -> list[str]:
    base = {
        "model": "tiny",
        "lr": 1e-3,
        **data_flags(data["spec"], data["prefix"]["run"], 16),
        "micro-batch-size": 2,
        "global-batch-size": 4,
        **ONE_LAYER,
        "train-iters": 1,
        "eval-interval": 0,
        **tempnet_flags(16),
        "num-workers": 0,
        "data-cache-path": str(tmp / "cache"),
    }
    return cli_flags(base, **flags)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _names_both_tokenizers(line: str, data, prefix: str) -> bool:
    ids = data["identity"]
    return prefix in line and ids["run"].describe() in line and ids["other"].describe() in line


def test_a_dataset_of_another_tokenizer_stops_the_run_before_anything_is_written(data, tmp_path):
    save = tmp_path / "ckpt"
    other = data["prefix"]["other"]
    args = _args(data, tmp_path, **{"data-path": other, "save": save})
    r = run_entry_point("pretrain_gpt.py", 1, args, check=False)
    errors = _error_lines(r.stderr)
    assert r.returncode == 1 and len(errors) == 1, r.stderr[-3000:]
    assert _names_both_tokenizers(errors[0], data, other), errors[0]
    assert "Traceback" not in r.stderr
    assert not save.exists() and not (tmp_path / "cache").exists()


def test_an_id_outside_the_vocabulary_stops_every_rank_at_tp2(data, tmp_path):
    bad = data["prefix"]["bad_id"]
    flags = {"data-path": bad, "tensor-model-parallel-size": 2}
    running = Running("pretrain_gpt.py", _args(data, tmp_path, **flags), 2, str(tmp_path))
    r = running.start().wait(timeout=300)
    assert [p.exitcode for p in running.procs] == [1, 1], r.stderr[-3000:]
    errors = _error_lines(r.stderr)
    assert len(errors) == 2 and errors[0] == errors[1], r.stderr[-3000:]
    assert f"dataset {bad} holds token id {BAD_ID} (first at token {BAD_AT} " in errors[0]
    assert f"vocabulary of {VOCAB} ids" in errors[0] and "Traceback" not in r.stderr
    # the dataset has no tokenizer record: said once (rank 0), then its ids were checked
    assert r.stderr.count("its tokenizer cannot be checked") == 1


def test_evaluate_refuses_wrong_data_and_scores_the_right_data(data, tmp_path):
    run = tmp_path / "run"  # a checkpoint whose saved config names the run's tokenizer
    run_entry_point("pretrain_gpt.py", 1, _args(data, tmp_path, save=run))
    tool = os.path.join(REPO, "tools", "evaluate.py")
    evaluate = [sys.executable, tool, "--load", str(run), "--fixed-tau", "1"]
    evaluate += ["--max-documents", "2", "--data-path"]
    p = data["prefix"]
    r = run_command([*evaluate, p["other"]])
    errors = _error_lines(r.stderr)
    assert r.returncode == 1 and len(errors) == 1, r.stderr[-3000:]
    assert _names_both_tokenizers(errors[0], data, p["other"]) and "Traceback" not in r.stderr
    r = run_command([*evaluate, p["bad_id"]])
    errors = _error_lines(r.stderr)
    assert r.returncode == 1 and len(errors) == 1, r.stderr[-3000:]
    assert f"holds token id {BAD_ID} (first at token {BAD_AT} " in errors[0]
    r = run_command([*evaluate, p["run"]])
    assert r.returncode == 0 and '"ppl"' in r.stdout, r.stderr[-3000:]
