# kvtrace — `make run` starts the agent, `make test` runs the suite; both set the host up first.
VENV := .venv
KVTRACE := $(VENV)/bin/kvtrace
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

.PHONY: setup run test test-unit test-integration test-gpu bench install-service promtool clean

setup: $(STAMP)
	@# tracefs does not survive a reboot; the rest does.
	@test -e /sys/kernel/tracing/uprobe_events || mount -t tracefs nodev /sys/kernel/tracing

$(STAMP): pyproject.toml packaging/setup-host.sh
	bash packaging/setup-host.sh
	touch $@

# promtool (Debian ships it only in package `prometheus`) checks packaging/prometheus/ in the tests;
# that package also starts a Prometheus server, which a test host does not want: disable it.
promtool:
	@command -v promtool >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq --no-install-recommends prometheus >/dev/null && \
	  { systemctl disable --now prometheus >/dev/null 2>&1 || true; }; }

run: setup
	$(KVTRACE) agent $(ARGS)

test: setup promtool
	$(PYTHON) -m pytest tests/unit tests/integration $(PYTEST_ARGS)

test-unit: setup promtool
	$(PYTHON) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: setup
	$(PYTHON) -m pytest tests/integration $(PYTEST_ARGS)

# On the GPU machine (torch there): see tests/gpu/README.md.
test-gpu:
	bash tests/gpu/run.sh tests $(PYTEST_ARGS)

bench: setup
	$(PYTHON) bench/probe_overhead.py
	$(PYTHON) bench/throughput.py
	$(PYTHON) bench/stack_overhead.py
	$(PYTHON) bench/api_throughput.py
	$(PYTHON) bench/agent_memory.py

# systemd: the agent from this checkout, installed at /opt/kvtrace.
install-service:
	test "$(CURDIR)" = /opt/kvtrace || { echo "clone kvtrace to /opt/kvtrace first"; exit 1; }
	$(MAKE) setup
	getent group kvtrace >/dev/null || groupadd --system kvtrace
	install -m 0644 packaging/systemd/kvtrace.service /etc/systemd/system/kvtrace.service
	systemctl daemon-reload
	@echo "now: systemctl enable --now kvtrace"

clean:
	rm -rf $(VENV) build agent/*.egg-info .pytest_cache
