# Every target is self-sufficient on a fresh machine: it creates .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.narwhal-installed
# NIXL without its CUDA torch dependency: the UCX backend moves DRAM bytes on a CPU-only host.
NIXL_PKGS := nixl-cu12==1.5.1 nixl==1.5.1
# Real vLLM (CPU build) for the interop suite, in a venv of its own, and the tiny model it serves.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.narwhal-vllm-installed
TINY_MODEL ?= build/interop/tiny-llama
TINY_STAMP := $(TINY_MODEL)/narwhal-tiny.json

export UCX_NET_DEVICES ?= lo
export NIXL_LOG_LEVEL ?= WARN

.PHONY: install demo qualify test test-deps test-deps-prometheus test-deps-chromium test-deps-etcd bench-deps-valgrind check lint typecheck format bench clean

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

# The reference qualification run's whole chain on the simulated fleet (configs/qualify/), into
# runs/qualify-local-sim: a second run skips every step already done.
qualify: $(STAMP)
	$(VENV)/bin/narwhal-qualify configs/qualify/local-sim.yaml

# The observability tests run a real Prometheus and promtool (Debian's prometheus package, without
# its recommended node exporter). If it cannot be installed, those tests skip and say why.
test-deps-prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) || \
		echo "test-deps: prometheus not installed"

# The qualification report's test renders the page in a real browser (Debian's chromium,
# headless). If it cannot be installed, that test skips and says why (fails under `make test`).
# After test-deps-prometheus: two apt-gets side by side (`make -j4 test-env`) fight over its lock.
test-deps-chromium: test-deps-prometheus
	@command -v chromium >/dev/null || (apt-get -o DPkg::Lock::Timeout=600 update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
		--no-install-recommends chromium) || echo "test-deps: chromium not installed"

# The replica tests coordinate narwhal-serve replicas through a real etcd (Debian's etcd-server,
# started by the tests themselves on free ports, never as a system service). After chromium:
# one apt-get at a time.
test-deps-etcd: test-deps-chromium
	@command -v etcd >/dev/null || (apt-get -o DPkg::Lock::Timeout=600 update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
		--no-install-recommends etcd-server) || echo "test-deps: etcd-server not installed"

# The deployment tests deploy through a real sshd on 127.0.0.1 (Debian's openssh-server). If it
# cannot be installed, that test skips and says why; the rest of `make test` still runs.
test-deps: test-deps-prometheus test-deps-chromium test-deps-etcd
	@test -x /usr/sbin/sshd || (apt-get -o DPkg::Lock::Timeout=600 update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
		openssh-server) || echo "test-deps: openssh-server not installed"

# The whole suite, nothing skipped for want of a part: the real-vLLM interop suite (its venv
# and tiny model are built first, about 7 minutes on a fresh machine) and the aiperf
# cross-check run too, and fail rather than skip if their environment is missing.
test: export NARWHAL_INTEROP_REQUIRED := 1
test: export NARWHAL_AIPERF_REQUIRED := 1
test: export NARWHAL_BROWSER_REQUIRED := 1
test: export NARWHAL_ETCD_REQUIRED := 1
test: export NARWHAL_VLLM_VENV := $(VLLM_VENV)
test: export NARWHAL_TINY_MODEL := $(TINY_MODEL)
test:
	$(MAKE) --no-print-directory -j4 test-env
	@$(call two_passes,)

# Most tests wait on the processes they start (the suite keeps under one of the two cores busy
# on average), so they run in two pytest-xdist workers, a file's tests on one worker (its
# module fixtures built once); then the tests whose measurements another test sharing the cores
# would skew run alone (`solo`: tests/conftest.py lists them and why). Both passes always run;
# make fails if either did (with the first failure's status).
define two_passes
status=0; \
$(PY) -m pytest -q -n 2 --dist loadfile -m "not solo $(1)" --durations=30 || status=$$?; \
$(PY) -m pytest -q -m "solo $(1)" --durations=10 || { s=$$?; [ $$s -eq 5 ] || [ $$status -ne 0 ] || status=$$s; }; \
exit $$status
endef

# What the whole suite needs, built side by side (`make -j4` above): the three venvs and the
# system packages download and unpack independently, about two minutes less than one by one.
.PHONY: test-env
test-env: $(STAMP) typecheck test-deps aiperf interop-env

check: $(STAMP) typecheck
	$(PY) -m ruff check src tests bench tools
	$(PY) -m ruff format --check src tests bench tools
	@$(call two_passes,and not slow)

lint: $(STAMP) typecheck
	$(PY) -m ruff check src tests bench tools
	$(PY) -m ruff format --check src tests bench tools

# mypy over src/narwhal, configured in pyproject.toml ([tool.mypy]: strict on contract/,
# profiles/ and routing/). `make check` and `make test` run it before their tests.
typecheck: $(STAMP)
	$(PY) -m mypy

format: $(STAMP)
	$(PY) -m ruff format src tests bench tools
	$(PY) -m ruff check --fix src tests bench tools

bench: $(STAMP)
	$(PY) bench/kv_transfer.py

# bench/router_overhead.py --instructions counts the routers' instructions under callgrind
# (Debian's valgrind); nothing in `make test` needs it.
bench-deps-valgrind:
	@command -v callgrind_control >/dev/null || (apt-get -o DPkg::Lock::Timeout=600 update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
		--no-install-recommends valgrind)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache .mypy_cache

# The measurement tools' cross-check client: aiperf 0.13.0 pins orjson, prometheus-client and
# more that clash with the router's own, so it gets a venv of its own (under .venv/, ignored).
# Under a plain pytest, tests/measurement/test_aiperf_xcheck.py skips, saying so, until this has
# run; under `make test` (NARWHAL_AIPERF_REQUIRED=1) `make test` installs it and the test must run.
AIPERF_VENV := $(VENV)/aiperf
.PHONY: aiperf
aiperf: $(AIPERF_VENV)/bin/aiperf
$(AIPERF_VENV)/bin/aiperf: | $(PY)
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q --upgrade pip
	$(AIPERF_VENV)/bin/python -m pip install -q aiperf==0.13.0

# --- Real vLLM interop (tests/interop, docs/vllm-interop.md) ---------------------------------
# vLLM's CPU build in its own venv (it pins torch 2.13.0 CPU), and a tiny random Llama built
# locally from it. `make interop` builds both and runs tests/interop with
# NARWHAL_INTEROP_REQUIRED (a missing venv or model fails the suite instead of skipping it).
# Changing a build script rebuilds what it builds.

.PHONY: interop interop-env interop-venv interop-model clean-interop

$(VLLM_STAMP): tools/interop/build_venv.sh
	@rm -f $(VLLM_STAMP)
	bash tools/interop/build_venv.sh $(VLLM_VENV) $(PYTHON)

$(TINY_STAMP): tools/interop/make_tiny_model.py $(VLLM_STAMP)
	@rm -f $(TINY_STAMP)
	HF_HUB_OFFLINE=1 $(VLLM_PY) tools/interop/make_tiny_model.py $(TINY_MODEL)

interop-venv: $(VLLM_STAMP)
interop-model: $(TINY_STAMP)
interop-env: interop-venv interop-model

# `make interop` builds both and runs only the interop suite; `make test` runs it with the rest.
interop: export NARWHAL_INTEROP_REQUIRED := 1
interop: export NARWHAL_VLLM_VENV := $(VLLM_VENV)
interop: export NARWHAL_TINY_MODEL := $(TINY_MODEL)

interop: $(STAMP) interop-env
	$(PY) -m pytest -q tests/interop

clean-interop:
	rm -rf $(VLLM_VENV) build/interop
