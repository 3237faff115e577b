"""packaging/grafana/kvtrace-dashboard.json: valid, templated on its data source, has the panels the
operator needs, and every query reads only metrics the exporter exports (and is valid PromQL when
promtool is here)."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kvtrace.servers.metrics import METRICS
from test_prometheus_promql import metric_names, variable_query_metric_names

DASHBOARD = Path(__file__).resolve().parents[2] / "packaging" / "grafana" / "kvtrace-dashboard.json"
EXPORTED = {spec.name for spec in METRICS}


def load():
    return json.loads(DASHBOARD.read_text())


def panels(items=None):
    """Every panel, rows' nested panels included."""
    for panel in load()["panels"] if items is None else items:
        yield panel
        yield from panels(panel.get("panels", []))


def queries():
    for panel in panels():
        for target in panel.get("targets", []):
            if "expr" in target:
                yield panel["title"], target["expr"]


def variable_queries():
    for variable in load()["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield variable["name"], query["query"] if isinstance(query, dict) else query


def test_every_query_names_only_exported_metrics():
    seen = set()
    for title, expr in queries():
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        assert names <= EXPORTED, f"{title}: {sorted(names - EXPORTED)} not exported (in {expr!r})"
        seen |= names
    for name, query in variable_queries():
        names = variable_query_metric_names(query)
        assert names <= EXPORTED, f"variable {name}: {sorted(names - EXPORTED)} not exported"
        seen |= names
    # the operator-facing metrics are all on the dashboard
    assert {"kvtrace_outstanding_bytes", "kvtrace_growth_bytes_per_second", "kvtrace_unattributed_bytes",
            "kvtrace_time_to_oom_seconds", "kvtrace_leak_suspects", "kvtrace_leak_suspect_bytes",
            "kvtrace_events_lost_total", "kvtrace_component_up"} <= seen


def test_the_panels_the_issue_asks_for():
    titles = {panel["title"].lower(): panel for panel in panels()}

    def find(words):
        found = [panel for title, panel in titles.items() if words in title]
        assert found, f"no panel about {words!r}; panels: {sorted(titles)}"
        return found[0]

    assert "kvtrace_outstanding_bytes" in json.dumps(find("outstanding")["targets"])
    assert find("growth")["type"] == "heatmap"
    find("unattributed")
    find("time to oom")
    find("leak suspects")
    find("lost events")


def test_the_data_source_is_a_template_variable():
    dashboard = load()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in panels():
        if panel.get("type") == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"])["uid"] == "${datasource}", panel["title"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == "${datasource}"
    assert "__inputs" not in dashboard  # nothing to fill in at import
    # every query is scoped to the chosen hosts
    for title, expr in queries():
        assert 'instance=~"$instance"' in expr, title


def test_panel_ids_are_unique_and_laid_out():
    ids = [panel["id"] for panel in panels()]
    assert len(ids) == len(set(ids))
    for panel in panels():
        grid = panel["gridPos"]
        assert grid["w"] <= 24 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        assert panel.get("description"), f"{panel['title']}: say what the operator is looking at"


def test_queries_are_valid_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found (Debian package `prometheus`); `make test` installs it")
    # promtool checks rule expressions: wrap each query as a recording rule.
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for index, (_, expr) in enumerate(queries()):
        rules += [f"      - record: dashboard:query{index}", f"        expr: {json.dumps(expr)}"]
    path = tmp_path / "dashboard-queries.rules.yml"
    path.write_text("\n".join(rules) + "\n")
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
