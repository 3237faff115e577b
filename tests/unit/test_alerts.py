"""packaging/prometheus/kvtrace-alerts.yml: promtool accepts the rules and their unit tests pass
(kvtrace-alerts.test.yml fires and quiets every alert); every expression reads only exported
metrics; every alert has a severity and annotations an operator can act on."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvtrace.servers.metrics import METRICS
from test_prometheus_promql import metric_names

yaml = pytest.importorskip("yaml")

RULES_DIR = Path(__file__).resolve().parents[2] / "packaging" / "prometheus"
RULES = RULES_DIR / "kvtrace-alerts.yml"
RULE_TESTS = RULES_DIR / "kvtrace-alerts.test.yml"
EXPORTED = {spec.name for spec in METRICS}
# The five, and two that guard the others.
EXPECTED_ALERTS = {"KvtraceGpuMemoryGrowing", "KvtraceGpuMemoryAlmostFull", "KvtraceTimeToOomShort",
                   "KvtraceLeakSuspects", "KvtraceEventsLost", "KvtraceComponentDown", "KvtraceLedgerFull",
                   "KvtraceFlightDumpWritten",  # docs/recordings.md
                   # group kvtrace-vllm, one per detector (tests/unit/test_vllm_recipe.py checks the rest)
                   "KvtraceVllmBlocksHeldAfterFinish", "KvtraceVllmKvUsageStuck", "KvtraceVllmFreeBlocksFalling",
                   "KvtraceVllmLowBlockFreeRatio", "KvtraceVllmIdleGrowth", "KvtraceVllmSleepResidue"}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        print("promtool not found: install the Debian package `prometheus` (make test does)")
        pytest.skip("promtool not found (Debian package `prometheus`); `make test` installs it")
    return path


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=RULES_DIR, timeout=120)


def alerts() -> dict[str, dict]:
    document = yaml.safe_load(RULES.read_text())
    return {rule["alert"]: rule for group in document["groups"] for rule in group["rules"] if "alert" in rule}


def test_promtool_check_rules():
    result = run("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_promtool_rule_unit_tests():
    result = run("test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_expected_alerts_exist():
    assert set(alerts()) == EXPECTED_ALERTS


def test_every_alert_reads_only_exported_metrics():
    for name, rule in alerts().items():
        names = metric_names(rule["expr"])
        assert names, name
        assert names <= EXPORTED, f"{name}: {sorted(names - EXPORTED)} not exported"
        for text in rule["annotations"].values():  # {{ query "..." }} in annotations too
            for query in re.findall(r"printf\s+`([^`]*)`", text):
                assert metric_names(query) <= EXPORTED, name


def test_every_alert_is_actionable():
    for name, rule in alerts().items():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        summary, description = rule["annotations"]["summary"], rule["annotations"]["description"]
        assert "{{ $labels.instance }}" in summary, f"{name}: the summary must say which host"
        assert len(summary) < 200, name
        assert "kvtrace " in description or "journalctl" in description, f"{name}: say what to run"


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    document = yaml.safe_load(RULE_TESTS.read_text())
    fired, quiet = set(), set()
    for case in document["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert fired == EXPECTED_ALERTS
    assert quiet == EXPECTED_ALERTS


def test_thresholds_are_the_agreed_ones():
    rules = alerts()
    assert "> 5e6" in rules["KvtraceGpuMemoryGrowing"]["expr"]
    assert "> 8 * 1024^3" in rules["KvtraceGpuMemoryGrowing"]["expr"]
    assert rules["KvtraceGpuMemoryGrowing"]["for"] == "15m"
    assert "> 0.92" in rules["KvtraceGpuMemoryAlmostFull"]["expr"]
    assert rules["KvtraceGpuMemoryAlmostFull"]["for"] == "30s"
    assert "< 600" in rules["KvtraceTimeToOomShort"]["expr"]
    assert rules["KvtraceTimeToOomShort"]["labels"]["severity"] == "critical"
    assert rules["KvtraceLeakSuspects"]["for"] == "10m"
    assert "increase(kvtrace_events_lost_total" in rules["KvtraceEventsLost"]["expr"]
