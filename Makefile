# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= runs/demo

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: venv demo test lint prometheus clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or run make PYTHON=/path/to/python3.11" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/soma demo $(DEMO_DIR) --preset tiny

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# tests/test_prometheus.py scrapes Ray with a real Prometheus: Debian's package, installed when root can (as in CI);
# elsewhere those tests are skipped and say why
prometheus:
	@command -v prometheus >/dev/null && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && \
		    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; }; } \
		&& echo "installed $$(prometheus --version 2>&1 | head -1)" \
		|| echo "prometheus could not be installed: the Prometheus tests will be skipped" >&2; \
	else echo "prometheus not installed (needs root and apt-get): the Prometheus tests will be skipped" >&2; fi

clean:
	rm -rf $(VENV) runs
