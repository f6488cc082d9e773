# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= runs/demo

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: venv demo test check lint prometheus netns mlflow clean

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

# what CI runs, in one place (.ci/run): lint, the Prometheus and MLflow servers that make test alone leaves out
# (their tests skip, saying why), then the suite
check:
	PYTEST_ARGS="$(PYTEST_ARGS)" ./.ci/run

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

# tests/test_netns.py runs Ray on real hosts in network namespaces: iproute2 (ip, tc) and nftables (packet loss),
# installed when root can (as in CI); elsewhere those tests are skipped and say why
netns:
	@command -v ip >/dev/null && command -v tc >/dev/null && command -v nft >/dev/null && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 nftables >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && \
		    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 nftables >/dev/null 2>&1; }; } \
		&& echo "installed $$(nft --version 2>&1 | head -1), $$(ip -V 2>&1 | head -1)" \
		|| echo "iproute2/nftables could not be installed: the network namespace tests will be skipped" >&2; \
	else echo "iproute2/nftables not installed (needs root and apt-get): the network namespace tests will be skipped" >&2; fi

# tests/test_tracking_mlflow.py runs a real MLflow tracking server: full mlflow, whose pyarrow<26 conflicts with
# soma's pin, so in a venv of its own; where it cannot install (no network) those tests are skipped and say why
MLFLOW_VENV := .venv-mlflow
MLFLOW_STAMP := $(MLFLOW_VENV)/.installed
mlflow: $(MLFLOW_STAMP)

$(MLFLOW_STAMP):
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: the MLflow server tests will be skipped" >&2; exit 0; }; \
	{ $(PYTHON) -m venv $(MLFLOW_VENV) && $(MLFLOW_VENV)/bin/python -m pip install --quiet mlflow==3.17.2 && touch $(MLFLOW_STAMP) \
	  && echo "installed $$($(MLFLOW_VENV)/bin/mlflow --version 2>&1 | tail -1)"; } \
	|| echo "mlflow could not be installed into $(MLFLOW_VENV): the MLflow server tests will be skipped" >&2

clean:
	rm -rf $(VENV) $(MLFLOW_VENV) runs
