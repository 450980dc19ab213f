# make test        create/refresh .venv, install everything, run the test suite
# make quickstart  create/refresh .venv; corpus, tokenizer, preprocessing, a tiny GPT then
#                  TempNet trained at TP=2 on CPU, held-out perplexities and tau per token
#                  (examples/quickstart.py)
# make install     only create/refresh .venv
# make lint     ruff check + format check
# make bench    loss benchmark (prints a table)
# make bench-data  preprocessing throughput and memory on a generated 200 MB .jsonl.zst
# make bench-step  training step: fused vs unfused attention, DRO + TempNet vs CE, the planner
# make bench-stage the whole output stage: today's (logits formed whole) vs the fused one
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test install lint format bench bench-data bench-step bench-stage quickstart clean

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

quickstart: $(STAMP)
	$(BIN)/python examples/quickstart.py $(ARGS)

install: $(STAMP)

# Order matters: torch first (2.13.0 CPU build here; a bare `torch` would pull a CUDA build),
# then DeepSpeed without build isolation and with no ops compiled, then the project.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -c constraints.txt torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -c constraints.txt --no-build-isolation deepspeed
	$(BIN)/python -m pip install -c constraints.txt -e '.[test,eval,wandb]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/python benchmarks/loss_bench.py

bench-data: $(STAMP)
	$(BIN)/python benchmarks/preprocess_bench.py

bench-step: $(STAMP)
	$(BIN)/python benchmarks/step_bench.py $(ARGS)

bench-stage: $(STAMP)
	$(BIN)/python benchmarks/loss_bench.py --section stage --tokens 8192 $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
