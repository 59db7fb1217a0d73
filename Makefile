# Two commands on a fresh machine: `make demo` (set up + the demo check) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch first, pinned: the CPU build on this machine's disk; the package's own range (torch>=2.4)
	# is then already met and pip never pulls a multi-GB CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tpcheck run --mode all --world-size 2 --json reports/demo.json --html reports/demo.html

test: $(STAMP) lint
	$(PY) -m pytest -q -ra

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) reports build
