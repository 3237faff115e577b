# kvtrace — `make run` starts the agent, `make test` runs the suite; both set the host up first.
VENV := .venv
KVTRACE := $(VENV)/bin/kvtrace
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

.PHONY: setup run test test-unit test-integration test-gpu bench clean

setup: $(STAMP)
	@# tracefs does not survive a reboot; the rest does.
	@test -e /sys/kernel/tracing/uprobe_events || mount -t tracefs nodev /sys/kernel/tracing

$(STAMP): pyproject.toml packaging/setup-host.sh
	bash packaging/setup-host.sh
	touch $@

run: setup
	$(KVTRACE) agent $(ARGS)

test: setup
	$(PYTHON) -m pytest tests/unit tests/integration $(PYTEST_ARGS)

test-unit: setup
	$(PYTHON) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: setup
	$(PYTHON) -m pytest tests/integration $(PYTEST_ARGS)

# On the GPU machine (torch there): see tests/gpu/README.md.
test-gpu:
	python3 -m pytest tests/gpu -m gpu $(PYTEST_ARGS)

bench: setup
	$(PYTHON) bench/probe_overhead.py
	$(PYTHON) bench/throughput.py

clean:
	rm -rf $(VENV) build agent/*.egg-info .pytest_cache
