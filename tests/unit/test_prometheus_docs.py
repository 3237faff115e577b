"""docs/metrics.md and the exporter agree exactly: the same metrics, types, units, labels and
meanings (the meaning column is each metric's # HELP text, as a scrape shows it)."""
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtrace.servers.metrics import METRICS, KvtraceCollector

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
_ROW = re.compile(r"^\|\s*`(?P<name>kvtrace_\w+)`\s*\|(?P<type>[^|]*)\|(?P<unit>[^|]*)\|(?P<labels>[^|]*)\|"
                  r"(?P<meaning>[^|]*)\|\s*$")


def documented() -> dict[str, tuple[str, str, tuple[str, ...], str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        match = _ROW.match(line)
        if not match:
            continue
        labels = tuple(re.findall(r"`(\w+)`", match["labels"]))
        assert match["name"] not in rows, f"{match['name']} is documented twice"
        rows[match["name"]] = (match["type"].strip(), match["unit"].strip(), labels, match["meaning"].strip())
    return rows


def test_the_table_parses():
    rows = documented()
    assert len(rows) >= 20
    assert rows["kvtrace_outstanding_bytes"][2] == ("pid", "title", "gpu", "layer", "memory")


def test_the_table_is_exactly_the_exporters_metrics():
    declared = {spec.name: (spec.type, spec.unit, spec.labels, spec.help) for spec in METRICS}
    assert documented() == declared


def test_the_table_is_exactly_what_a_scrape_shows():
    class Empty:  # an agent with no snapshot yet still describes every metric
        latest = None

        def ledger_counts(self):
            raise RuntimeError("unused")

        def components(self):
            return []

        def counters(self):
            return {}

        def process_titles(self):
            return {}

        def shares(self):
            return []

        def cross_checks(self):
            return []

        def cross_check_totals(self):
            return {}

        def process_depths(self):
            return {}

    registry = CollectorRegistry()
    registry.register(KvtraceCollector(Empty(), Empty()))
    scraped = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        name = family.name + "_total" if family.type == "counter" else family.name
        scraped[name] = (family.type, family.documentation)
    assert {name: (row[0], row[3]) for name, row in documented().items()} == scraped


def test_the_documented_names_follow_prometheus_naming():
    base_units = {"bytes", "seconds", "total", "info", "up", "suspects", "objects", "second", "ratio", "libraries",
                  # vLLM's own nouns (the names the issue fixed): blocks, requests, a level, a finding
                  "blocks", "requests", "finish", "allocation", "level", "finding",
                  "processes",
                  "depth"}  # kvtrace_process_depth: a level, 1 to 3
    for name, (kind, unit, labels, _) in documented().items():
        assert re.fullmatch(r"kvtrace_[a-z0-9_]+", name), name
        assert (kind == "counter") == name.endswith("_total"), name
        assert name.rsplit("_", 1)[-1] in base_units, name
        if unit == "bytes":
            assert name.endswith("_bytes"), name
        if unit == "seconds":
            assert name.endswith("_seconds"), name
        assert not {"stack", "address", "caller", "frame"} & set(labels), name
