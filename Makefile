# Every target is self-sufficient on a fresh machine: it creates .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.narwhal-installed
# NIXL without its CUDA torch dependency: the UCX backend moves DRAM bytes on a CPU-only host.
NIXL_PKGS := nixl-cu12==1.5.1 nixl==1.5.1

export UCX_NET_DEVICES ?= lo
export NIXL_LOG_LEVEL ?= WARN

.PHONY: install demo test test-deps check lint format bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(NIXL_PKGS)
	$(PY) -c "import nixl._api"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m narwhal.demo --fleet configs/fleet/local-sim.json

# The deployment tests deploy through a real sshd on 127.0.0.1 (Debian's openssh-server). If it
# cannot be installed, that test skips and says why; the rest of `make test` still runs.
test-deps:
	@test -x /usr/sbin/sshd || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq openssh-server) || echo "test-deps: openssh-server not installed"

test: $(STAMP) test-deps
	$(PY) -m pytest -q

check: $(STAMP)
	$(PY) -m ruff check src tests bench tools
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(PY) -m ruff check src tests bench tools
	$(PY) -m ruff format --check src tests bench tools

format: $(STAMP)
	$(PY) -m ruff format src tests bench tools
	$(PY) -m ruff check --fix src tests bench tools

bench: $(STAMP)
	$(PY) bench/kv_transfer.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
