# dgc: Deep Gradient Compression for PyTorch. `make help` lists the targets.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Debian packages holding the offline data sets (installed when root with apt)
DEB_DATA := dataset-fashion-mnist bible-kjv-text bible-kjv espeak-ng pocketsphinx-testdata

.PHONY: help install test test-all lint format bench clean

help: ## list the targets
	@grep -E '^[a-zA-Z0-9_.-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

$(PY):
	python3 -m venv $(VENV)

install: $(PY) ## create .venv, install dgc and its dependencies (and the offline data packages when root with apt); idempotent
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=$$(for p in $(DEB_DATA); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then \
	    echo "apt-get install $$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  fi; \
	else echo "not root with apt: skipping Debian data packages ($(DEB_DATA))"; fi
	@$(PIP) install -q -e '.[dev,wandb]' > $(VENV)/pip-install.log 2>&1 || { cat $(VENV)/pip-install.log; exit 1; }
	@$(PY) -c "import dgc, torch; print('dgc', dgc.__version__, 'torch', torch.__version__)"

test: install ## run the test suite (CPU, gloo; what CI runs)
	$(PY) -m pytest -q -m "not slow and not gpu"

test-all: install ## every test, including slow and GPU-marked ones
	$(PY) -m pytest -q

lint: ## ruff check and format check
	$(VENV)/bin/ruff check dgc tests tasks
	$(VENV)/bin/ruff format --check dgc tests tasks

format: ## apply ruff fixes and formatting
	$(VENV)/bin/ruff check --fix dgc tests tasks
	$(VENV)/bin/ruff format dgc tests tasks

bench: install ## selection and wire-size benchmarks, JSON under results/bench/
	$(PY) -m dgc.bench select
	$(PY) -m dgc.bench wire --model resnet50

clean: ## remove caches (keeps .venv and results/)
	rm -rf .pytest_cache .ruff_cache build *.egg-info
