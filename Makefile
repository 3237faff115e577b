# kvtrace — `make run` starts the agent, `make test` runs the suite; both set the host up first.
VENV := .venv
KVTRACE := $(VENV)/bin/kvtrace
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

# buf (protobuf lint and breaking-change check) comes from npm, pinned; npm from the distribution.
BUF_VERSION := 1.75.0
BUF := .tools/node_modules/.bin/buf
# speedscope's file-format schema, which tests/unit/test_flamegraph.py checks speedscope exports against,
# comes with its npm package, pinned. npm brings node, which tests/unit/test_perfetto.py runs Perfetto's
# trace processor (WebAssembly) in.
SPEEDSCOPE_VERSION := 1.25.0
NPM_FROM_DISTRIBUTION := command -v npm >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq --no-install-recommends npm >/dev/null; }

.PHONY: setup run test test-unit test-integration test-gpu lint proto-release bench install-service promtool speedscope pythons clean

setup: $(STAMP)
	@# tracefs does not survive a reboot; the rest does.
	@test -e /sys/kernel/tracing/uprobe_events || mount -t tracefs nodev /sys/kernel/tracing

$(STAMP): pyproject.toml packaging/setup-host.sh
	bash packaging/setup-host.sh
	touch $@

# promtool (Debian ships it only in package `prometheus`) checks packaging/prometheus/ in the tests, and
# amtool (package `prometheus-alertmanager`) packaging/alertmanager/;
# those packages also start their servers, which a test host does not want: disable them.
promtool:
	@command -v promtool >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq --no-install-recommends prometheus >/dev/null && \
	  { systemctl disable --now prometheus >/dev/null 2>&1 || true; }; }
	@command -v amtool >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq --no-install-recommends prometheus-alertmanager >/dev/null && \
	  { systemctl disable --now prometheus-alertmanager >/dev/null 2>&1 || true; }; }

$(BUF):
	@$(NPM_FROM_DISTRIBUTION)
	npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@$(BUF_VERSION)

# Installed again when the pinned version changes.
speedscope:
	@grep -qs '"version": "$(SPEEDSCOPE_VERSION)"' .tools/node_modules/speedscope/package.json || { \
	  $(NPM_FROM_DISTRIBUTION) && \
	  npm install --silent --no-audit --no-fund --save-exact --prefix .tools speedscope@$(SPEEDSCOPE_VERSION); }

# The gate CI runs before the tests: ruff, mypy over the package, buf lint, and buf breaking against
# kvtrace.v1 as last released (proto/released.binpb; a breaking change needs a new package, v2).
lint: setup $(BUF)
	$(VENV)/bin/ruff check agent tests bench proto
	$(VENV)/bin/mypy
	cd proto && ../$(BUF) lint
	$(BUF) breaking proto --against proto/released.binpb

# At a release: the proto as it is now becomes the baseline that later changes must not break.
proto-release: $(BUF)
	$(BUF) build proto -o proto/released.binpb

run: setup
	$(KVTRACE) agent $(ARGS)

# A stack test whose interpreter `make pythons` should have built fails, not skips (tests/interpreters.py).
test test-unit test-integration: export KVTRACE_REQUIRE_PYTHONS = 1

test: setup promtool speedscope pythons
	$(PYTHON) -m pytest tests/unit tests/integration $(PYTEST_ARGS)

test-unit: setup promtool speedscope pythons
	$(PYTHON) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: setup pythons
	$(PYTHON) -m pytest tests/integration $(PYTEST_ARGS)

# CPython 3.14 and 3.15 (each also free-threaded) for the stack tests, built once from Debian's source
# packages where missing (tests/pythons/build.sh; two to six minutes each on two cores). Not for `make run`.
pythons: setup
	KVTRACE_VENV_PYTHON=$(PYTHON) bash tests/pythons/build.sh

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
	rm -rf $(VENV) .tools build agent/*.egg-info .pytest_cache
