# Two commands on a fresh machine: `make demo` (set up + the demo check) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-slow test-all lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch first, pinned: the CPU build on this machine's disk; the package's own range (torch>=2.4)
	# is then already met and pip never pulls a multi-GB CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

# The seed-compatible JSON goes to reports/demo-seed.json (--seed-json), so that the summary is
# what the screen ends with; then how to run the README's next commands. Exits with tpcheck's code.
DEMO_RUN := $(VENV)/bin/tpcheck run --mode all --world-size 2 --json reports/demo.json \
	--html reports/demo.html --seed-json reports/demo-seed.json

demo: $(STAMP)
	mkdir -p reports  # tpcheck writes into existing directories only
	@echo '$(DEMO_RUN)'; code=0; $(DEMO_RUN) || code=$$?; \
	echo "next: '. $(VENV)/bin/activate' puts tpcheck on PATH for the README's Use commands" \
		"(e.g. tpcheck faults); or call $(VENV)/bin/tpcheck"; \
	exit $$code

# two pytest workers (pytest-xdist), a test file per worker at a time (module fixtures run once)
PARALLEL := -n 2 --dist loadfile

# every change: lint and every test not marked slow (~4 min here)
test: $(STAMP) lint
	$(PY) -m pytest -q -ra -m "not slow" $(PARALLEL)

# what `make test` leaves out (the 2,000-case false-alarm sweep, the catalogue on every block, world size
# and 16-bit dtype, the detectability probes, the HuggingFace sweep's architectures, ...): CI runs it too
test-slow: $(STAMP)
	$(PY) -m pytest -q -ra -m slow $(PARALLEL)

# everything, as CI runs it
test-all: test test-slow

# the project's own trees only (ruff's `include` in pyproject.toml says the same): a case file a user
# writes beside them (`tpcheck new my_case.py`) is theirs, not the project's to lint
LINTED := src tests examples benchmarks docs

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) reports build
