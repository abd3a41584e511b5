# Two commands for a fresh machine: `make run` (main job) and `make test` (test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
# torch goes in first, pinned, so no later dependency pulls a different (e.g. CUDA) build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test test-all lint bench clean

# The runtime set only (what `make run` needs); the tests add the dev extras on top.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

# Main job: train the debug preset on the shipped corpus; results land in runs/debug/.
run: $(VENV)/.installed
	$(VENV)/bin/shardwise train --config configs/debug.toml --run.overwrite true

test: $(VENV)/.dev-installed
	$(PY) -m ruff check .
	$(PY) -m pytest -q --durations=15

# Everything, including the extended layout matrix and the long documented commands (test_docs_commands.py).
test-all: $(VENV)/.dev-installed
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m ""

bench: $(VENV)/.dev-installed
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) runs
