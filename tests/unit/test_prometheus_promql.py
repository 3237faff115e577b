"""The metric names a PromQL expression reads, for the dashboard and alert tests; and its own tests.

Not a PromQL parser: it drops strings, label matchers, ranges, label lists of by/on/without/
ignoring/group_*, Grafana variables and numbers, then takes every identifier that is not a keyword
or a function call. Names given only as {__name__="..."} are not seen (none of ours are).
"""
import re

import pytest

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
             "bool", "offset", "inf", "nan", "start", "end",
             # aggregation operators: `sum by (x) (...)` leaves `sum` without its parenthesis
             "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
             "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_OFFSET = re.compile(r"\boffset\s+-?[0-9a-z]+")
_TOKEN = re.compile(r"(?P<number>0[xX][0-9a-fA-F]+|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)"
                    r"|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?P<call>\s*\()?")


def metric_names(expr: str) -> set[str]:
    expr = _STRING.sub('""', expr)
    expr = _GRAFANA_VARIABLE.sub("", expr)
    expr = _MATCHERS.sub("{}", expr)
    expr = _RANGE.sub("[]", expr)
    expr = _LABEL_LIST.sub(r"\1", expr)
    expr = _OFFSET.sub("", expr)
    names = set()
    for token in _TOKEN.finditer(expr):
        name = token["name"]
        if name and not token["call"] and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


# Grafana's label_values(metric, label) / label_values(label) in template variables.
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<selector>.+?)\s*,\s*)?\w+\s*\)\s*$")


def variable_query_metric_names(query: str) -> set[str]:
    match = _LABEL_VALUES.match(query)
    if match:
        return metric_names(match["selector"]) if match["selector"] else set()
    query = re.sub(r"^\s*query_result\((.*)\)\s*$", r"\1", query)
    return metric_names(query)


@pytest.mark.parametrize("expr, names", [
    ('kvtrace_outstanding_bytes', {"kvtrace_outstanding_bytes"}),
    ('sum by (instance, pid, gpu) (kvtrace_outstanding_bytes{layer=~"driver|vmm", memory="device"}) > 8 * 1024^3',
     {"kvtrace_outstanding_bytes"}),
    ('kvtrace_growth_bytes_per_second{window="1m"} > 5e6\nand on (instance, pid, gpu)\nsum by (instance, pid, gpu)'
     ' (kvtrace_outstanding_bytes{layer=~"driver|vmm"}) > 8 * 1024^3',
     {"kvtrace_growth_bytes_per_second", "kvtrace_outstanding_bytes"}),
    ('increase(kvtrace_events_lost_total{instance=~"$instance"}[5m]) > 0', {"kvtrace_events_lost_total"}),
    ('rate(a_total[$__rate_interval]) / ignoring(le) group_left(title) b offset 1h', {"a_total", "b"}),
    ('sum(rate(x[5m:1m])) without (pid) or vector(0) unless on() absent(y{z="w"})', {"x", "y"}),
    ('histogram_quantile(0.9, sum by (le) (rate(h_bucket[5m]))) > bool 0x10', {"h_bucket"}),
    ('label_replace(up, "dst", "$1", "src", "(.*)") == Inf', {"up"}),
    ('kvtrace_gpu_memory_used_bytes / (kvtrace_gpu_memory_total_bytes > 0) > 0.92',
     {"kvtrace_gpu_memory_used_bytes", "kvtrace_gpu_memory_total_bytes"}),
])
def test_metric_names(expr, names):
    assert metric_names(expr) == names


@pytest.mark.parametrize("query, names", [
    ("label_values(kvtrace_build_info, instance)", {"kvtrace_build_info"}),
    ('label_values(kvtrace_component_up{instance=~"$instance"}, component)', {"kvtrace_component_up"}),
    ("label_values(instance)", set()),
    ("query_result(topk(5, kvtrace_leak_suspect_bytes))", {"kvtrace_leak_suspect_bytes"}),
])
def test_variable_query_metric_names(query, names):
    assert variable_query_metric_names(query) == names
