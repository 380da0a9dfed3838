# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow install browser lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	rm -rf runs/demo
	$(VENV)/bin/remesh run examples/gpt/job.toml --checkpoint-dir runs/demo/checkpoints \
		--chaos lose@40,add@80 --summary runs/demo/summary.json --store runs/demo/fleet.db

# The dashboard tests drive Debian's chromium, headless; installed here when missing (as root).
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  { echo "make test needs Debian's chromium for the dashboard tests: sudo apt-get install chromium"; exit 1; }

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(STAMP) browser lint
	$(PY) -m pytest -q -m "not slow"

# The slow tier (the partitioner corpus, the model recipes, a token-file job resumed on fewer hosts, the coordinator's loss and a loss in a save end to end, the fault storm): 33 min in CI before the two end-to-end runs moved here (about 6 min more), the storm about 10 of them; CI runs it after `make test`.
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache
