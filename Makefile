# The targets here are what the README and CI call.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py | cksum | cut -d' ' -f1)
TEST_STAMP := $(VENV)/.installed-test-$(shell cat pyproject.toml setup.py | cksum | cut -d' ' -f1)
BENCH_STAMP := $(VENV)/.installed-bench-$(shell cat pyproject.toml setup.py | cksum | cut -d' ' -f1)

.PHONY: run test test-fast lint bench bench-smoke clean install proto build browser screenshots

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel

$(STAMP): $(VENV)/bin/python pyproject.toml setup.py
	$(PY) -m pip install -q -e .
	touch $@

# The test extra is a superset of the plain install: mark both done (the README walkthrough
# test runs `make run`, which would otherwise reinstall the package).
$(TEST_STAMP): $(VENV)/bin/python pyproject.toml setup.py
	$(PY) -m pip install -q -e '.[test]'
	touch $@ $(STAMP)

$(BENCH_STAMP): $(VENV)/bin/python pyproject.toml setup.py
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

install: $(STAMP)

# Rebuild the C extension in place whenever its source changed.
simpler_daemon/mailbox/_mailbox%.so: $(wildcard simpler_daemon/mailbox/_mailbox*.c simpler_daemon/mailbox/_mailbox.h)
	$(PY) setup.py -q build_ext --inplace

build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

run: $(STAMP) build
	$(VENV)/bin/simpler-daemon serve $(ARGS)

lint: $(TEST_STAMP) build
	$(VENV)/bin/ruff check simpler_daemon tests benchmarks
	$(VENV)/bin/ruff format --check simpler_daemon tests benchmarks
	$(VENV)/bin/mypy

# The whole suite under uvloop, then every async test again under plain asyncio.
# TEST_PROCS pytest processes (pytest-xdist) share the tests out file by file (a module's
# daemon stays in one process): most of the suite's time is spent waiting for forked
# children and daemon subprocesses to start, so more processes than cores pay.
# TEST_PROCS=0 runs everything in this one process. Bytecode is cached (a machine that sets
# PYTHONDONTWRITEBYTECODE would otherwise compile the package again in every daemon and
# rewrite every test module's asserts again in every pytest process). A pytest process that
# crashes fails the run at once, naming the test it ran (--max-worker-restart 0): one that
# pytest-xdist replaces under --dist loadfile can leave the run waiting forever for work
# that never comes (pytest-xdist issues 784 and 1378).
TEST_PROCS ?= 4
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(TEST_PROCS) --dist loadfile --max-worker-restart 0
# The dashboard's browser tests (tests/server/test_dashboard_browser.py) drive Debian's
# Chromium through its chromedriver: installed here when absent and root; otherwise those
# tests skip and say why (pytest -ra lists the reason).
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q chromium chromium-driver \
	      || { apt-get update -q && apt-get install -y -q chromium chromium-driver; }; \
	  else \
	    echo "no /usr/bin/chromium or /usr/bin/chromedriver and not root: the dashboard's browser tests will skip"; \
	  fi; \
	fi

test: $(TEST_STAMP) build lint browser
	$(PYTEST) $(PYTEST_ARGS)
	SIMPLER_LOOP=asyncio $(PYTEST) -q -m asyncio $(PYTEST_ARGS)

# The suite while you work: without the chaos tests (everything under tests/faults/, and
# the few elsewhere that kill children on purpose) and the slow ones, under uvloop only.
test-fast: $(TEST_STAMP) build
	$(PYTEST) -m "not chaos and not slow" $(PYTEST_ARGS)

# BASELINE=REV (a commit, tag or branch): the same cells of ours on REV too, built in a
# temporary git worktree and alternated with the working tree; before/after columns.
BENCH_BASELINE = $(if $(BASELINE),--baseline $(BASELINE))

bench: $(BENCH_STAMP) build
	$(PY) -m benchmarks $(BENCH_BASELINE) $(BENCH_ARGS)

bench-smoke: $(TEST_STAMP) build
	$(PY) -m benchmarks --smoke $(BENCH_BASELINE) $(BENCH_ARGS)

# A bounded soak of a real daemon in phases (child kills, client churn, daemon restarts,
# remote host blips; not part of `make test`, a 60 s smoke of it is): every run
# accounted for, references, buffers, fds and RSS back after each phase, no leak.
# SOAK_ARGS="--seed N" reuses a seed.
.PHONY: soak
soak: $(STAMP) build
	$(PY) -m benchmarks.soak --seconds 300 $(SOAK_ARGS)

# docs/img/dashboard-*.png: a daemon with runs, each dashboard view captured in Chromium.
screenshots: $(TEST_STAMP) build browser
	$(PY) docs/screenshots.py

proto: $(TEST_STAMP)
	$(PY) -m simpler_daemon.protocol.gen_proto

clean:
	rm -rf build *.egg-info simpler_daemon/mailbox/*.so
