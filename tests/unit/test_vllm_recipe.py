"""Acting on kvtrace's vLLM figures: the kvtrace-vllm alert group (packaging/prometheus/kvtrace-alerts.yml),
the recording rules KEDA reads (kvtrace-recording.yml), the ScaledObject (packaging/keda/) and the
Alertmanager routes (packaging/alertmanager/). Every file parses; every metric they read is one the agent
exports (servers/metrics.py METRICS) or a rule recorded here; promtool checks and unit-tests the rules;
amtool checks the routes and where each alert goes. tests/unit/test_alerts.py runs the alerts' own
promtool tests and checks every alert's annotations."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvtrace.model.vllm import FindingKind
from kvtrace.servers.metrics import METRICS
from test_prometheus_promql import metric_names

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
RULES_DIR = ROOT / "packaging" / "prometheus"
ALERTS = RULES_DIR / "kvtrace-alerts.yml"
RECORDING = RULES_DIR / "kvtrace-recording.yml"
RECORDING_TESTS = RULES_DIR / "kvtrace-recording.test.yml"
SCALED_OBJECT = ROOT / "packaging" / "keda" / "vllm-scaledobject.yaml"
ROUTES = ROOT / "packaging" / "alertmanager" / "kvtrace-vllm-routes.yml"
DOC = ROOT / "docs" / "vllm.md"
EXPORTED = {spec.name for spec in METRICS}
VLLM_ALERTS = {"KvtraceVllmBlocksHeldAfterFinish", "KvtraceVllmKvUsageStuck", "KvtraceVllmFreeBlocksFalling",
               "KvtraceVllmLowBlockFreeRatio", "KvtraceVllmIdleGrowth", "KvtraceVllmSleepResidue"}


def load(path: Path):
    return yaml.safe_load(path.read_text())


def vllm_alerts() -> dict[str, dict]:
    (group,) = [group for group in load(ALERTS)["groups"] if group["name"] == "kvtrace-vllm"]
    return {rule["alert"]: rule for rule in group["rules"]}


def recording_rules() -> dict[str, str]:
    return {rule["record"]: rule["expr"] for group in load(RECORDING)["groups"] for rule in group["rules"]}


def keda_queries() -> list[str]:
    return [trigger["metadata"]["query"] for trigger in load(SCALED_OBJECT)["spec"]["triggers"]]


def tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found: it comes with the Debian package `{package}`")
    return path


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.mark.parametrize("path", [ALERTS, RECORDING, RECORDING_TESTS, SCALED_OBJECT, ROUTES],
                         ids=lambda path: path.name)
def test_every_file_parses(path):
    assert isinstance(load(path), dict)


def test_one_alert_per_detector():
    assert set(vllm_alerts()) == VLLM_ALERTS
    assert len(VLLM_ALERTS) == len([kind for kind in FindingKind if kind is not FindingKind.UNSPECIFIED])


def test_every_query_reads_exported_or_recorded_metrics():
    recorded = set(recording_rules())
    queries = {f"alert {name}": rule["expr"] for name, rule in vllm_alerts().items()}
    queries |= {f"record {name}": expr for name, expr in recording_rules().items()}
    queries |= {f"ScaledObject query {n}": query for n, query in enumerate(keda_queries())}
    for where, query in queries.items():
        names = metric_names(query)
        assert names, where
        unknown = sorted(names - EXPORTED - recorded)
        assert not unknown, f"{where}: {unknown} neither exported nor recorded"
    for name, rule in vllm_alerts().items():  # {{ query "..." }} in annotations too
        for text in rule["annotations"].values():
            for query in re.findall(r"printf\s+`([^`]*)`", text):
                assert metric_names(query) <= EXPORTED, name


def test_finding_kinds_named_in_rules_exist():
    kinds = {kind.label for kind in FindingKind}
    texts = [rule["expr"] for rule in vllm_alerts().values()] + list(recording_rules().values())
    for text in texts:
        for matcher in re.findall(r'kind=~?"([^"]*)"', text):
            assert set(matcher.split("|")) <= kinds, matcher


def test_thresholds_are_the_contracts_defaults():
    rules = vllm_alerts()
    assert "kvtrace_vllm_blocks_held_after_finish > 0" in rules["KvtraceVllmBlocksHeldAfterFinish"]["expr"]
    stuck = rules["KvtraceVllmKvUsageStuck"]
    assert "> 0" in stuck["expr"] and "== 0" in stuck["expr"] and stuck["for"] == "1m"
    assert "kvtrace_vllm_free_blocks_ratio < 0.95" in rules["KvtraceVllmFreeBlocksFalling"]["expr"]
    low = rules["KvtraceVllmLowBlockFreeRatio"]["expr"]
    assert "< 0.7" in low and "* 60 >= 100" in low
    idle = rules["KvtraceVllmIdleGrowth"]
    assert "kvtrace_vllm_idle_growth_bytes_per_second > 5e6" in idle["expr"] and idle["for"] == "10s"
    assert "unless on (instance, pid)" in idle["expr"] and "kvtrace_vllm_warming_up == 1" in idle["expr"]
    assert 'kvtrace_vllm_finding{kind="sleep_residue"} == 1' in rules["KvtraceVllmSleepResidue"]["expr"]


def test_every_vllm_alert_says_which_engine_and_what_to_run():
    for name, rule in vllm_alerts().items():
        description = rule["annotations"]["description"]
        assert "{{ $labels.pid }}" in rule["annotations"]["summary"], name
        assert "`kvtrace vllm --pid {{ $labels.pid }}`" in description, name


def test_promtool_check_recording_rules():
    result = run(tool("promtool", "prometheus"), "check", "rules", RECORDING.name, cwd=RULES_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(recording_rules())} rules found" in result.stdout


def test_promtool_recording_rule_unit_tests():
    result = run(tool("promtool", "prometheus"), "test", "rules", RECORDING_TESTS.name, cwd=RULES_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_recording_rule_is_unit_tested():
    tested = set()
    for case in load(RECORDING_TESTS)["tests"]:
        for check in case.get("promql_expr_test", []):
            tested |= metric_names(check["expr"])
    assert set(recording_rules()) <= tested, sorted(set(recording_rules()) - tested)


def test_scaled_object_targets_a_deployment_with_prometheus_triggers():
    spec = load(SCALED_OBJECT)["spec"]
    assert load(SCALED_OBJECT)["kind"] == "ScaledObject"
    assert spec["scaleTargetRef"]["kind"] == "Deployment"
    assert 0 < spec["minReplicaCount"] <= spec["maxReplicaCount"]  # never to zero: a model takes minutes to load
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus"
        assert trigger["metricType"] == "AverageValue"
        metadata = trigger["metadata"]
        assert float(metadata["threshold"]) > 0
        assert metadata["ignoreNullValues"] == "false"  # no data holds the replicas, never scales in
        assert metadata["serverAddress"].startswith("http")
        # one element, from the recording rules (so that promtool tested what KEDA reads)
        assert metadata["query"].startswith("sum(")
        assert metric_names(metadata["query"]) <= set(recording_rules())


def amtool() -> str:
    return tool("amtool", "prometheus-alertmanager")


def test_amtool_check_config():
    result = run(amtool(), "check-config", ROUTES.name, cwd=ROUTES.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize("labels, receivers", [
    (["alertname=KvtraceVllmKvUsageStuck", "severity=critical"], "vllm-drain,default"),
    (["alertname=KvtraceVllmBlocksHeldAfterFinish", "severity=critical"], "vllm-drain,default"),
    (["alertname=KvtraceVllmIdleGrowth", "severity=warning"], "default"),
    (["alertname=KvtraceTimeToOomShort", "severity=critical", "title=VLLM::Worker_TP0"], "vllm-drain,default"),
    (["alertname=KvtraceTimeToOomShort", "severity=critical", "title=python train.py"], "default"),
    (["alertname=KvtraceGpuMemoryAlmostFull", "severity=warning"], "default"),
])
def test_critical_vllm_alerts_reach_the_drain_hook(labels, receivers):
    result = run(amtool(), "config", "routes", "test", f"--config.file={ROUTES.name}", *labels, cwd=ROUTES.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == receivers


def test_critical_vllm_alerts_are_those_the_route_sends():
    critical = {name for name, rule in vllm_alerts().items() if rule["labels"]["severity"] == "critical"}
    assert critical == {"KvtraceVllmBlocksHeldAfterFinish", "KvtraceVllmKvUsageStuck"}


def test_the_doc_names_every_alert_and_file():
    text = DOC.read_text()
    for name in VLLM_ALERTS:
        assert f"`{name}`" in text, name
    for path in (ALERTS, RECORDING, SCALED_OBJECT, ROUTES):
        assert str(path.relative_to(ROOT)) in text, path


def test_the_docs_yaml_snippets_parse():
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks
    for block in blocks:
        yaml.safe_load(block)


def test_the_docs_scrape_config_is_valid(tmp_path):
    (block,) = [block for block in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
                if "scrape_configs" in block]
    config = tmp_path / "prometheus.yml"
    config.write_text(block)
    result = run(tool("promtool", "prometheus"), "check", "config", str(config), cwd=tmp_path)
    if "kubernetes_sd_configs not found" in result.stdout + result.stderr:
        pytest.skip("this promtool is built without Kubernetes discovery (Debian's is): upstream's checks it")
    assert result.returncode == 0, result.stdout + result.stderr
