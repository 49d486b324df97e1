# The README's two commands: `make serve` (the lock server, its dashboard and the
# edit-lock demo on the embedded SQLite store) and `make test`. Everything a command
# needs is installed by it, into .venv.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Debian packages the tests need (real servers are added here as stores land).
APT_PACKAGES := redis-server redis-sentinel postgresql memcached zookeeperd etcd-server nodejs chromium faketime iproute2

.PHONY: test serve demo lint bench chaos sysdeps venv clean

# Debian's own python3 needs python3-venv for `-m venv`: installed here when root.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); [ "$$(id -u)" = 0 ] && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null && \
	  $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed-base: $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -e .
	touch $@

$(VENV)/.installed-test: $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,bench]'
	touch $@ $(VENV)/.installed-base $(VENV)/.installed-server

$(VENV)/.installed-server: $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[server]'
	touch $@ $(VENV)/.installed-base

venv: $(VENV)/.installed-base

# Installs the Debian packages of APT_PACKAGES that are missing, when running as root.
sysdeps:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "warning: missing Debian packages (run as root to install):$$missing"; fi; \
	fi

lint: $(VENV)/.installed-test
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy --strict src

# Four workers on any machine: most tests wait on timers and servers, not on a CPU
# (the suite takes about 15 minutes in one process, under 5 in four).
test: sysdeps $(VENV)/.installed-test lint
	$(BIN)/python -m pytest -n 4

# HOST, PORT and STORE may be given: make serve PORT=8000 STORE=redis://localhost:6379/0
HOST ?= 127.0.0.1
PORT ?= 7420
STORE ?=
# A STORE of another kind than SQLite needs its client library: the extra of its scheme.
COMMA := ,
STORE_SCHEME = $(firstword $(subst +, ,$(firstword $(subst :, ,$(STORE)))))
STORE_EXTRA = $(filter redis postgresql memcached mongodb etcd zookeeper http,$(patsubst \
	rediss,redis,$(patsubst postgres,postgresql,$(patsubst etcds,etcd,$(patsubst \
	zookeepers,zookeeper,$(patsubst https,http,$(STORE_SCHEME)))))))
serve: $(VENV)/.installed-server
	$(if $(STORE_EXTRA),$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[server$(COMMA)$(STORE_EXTRA)]')
	$(BIN)/keymutex serve --host $(HOST) --port $(PORT) $(if $(STORE),--store $(STORE))

demo: $(VENV)/.installed-base
	$(BIN)/python examples/double_ticket_demo.py

bench: $(VENV)/.installed-test
	$(BIN)/python benchmarks/run_all.py

# The long safety run: 10,000 fenced writes per store under pauses and kills
# (tests/safety/chaos.py; `make test` runs a short one). CHAOS_ARGS: e.g. --stores redis
chaos: sysdeps $(VENV)/.installed-test
	cd tests && PYTHONPATH=. ../$(BIN)/python -m safety.chaos $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
