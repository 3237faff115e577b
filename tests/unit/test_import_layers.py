"""The package's imports flow one way: each module imports only from its own layer or the ones
below it (model at the bottom, the CLI at the top), as ARCHITECTURE.md draws the data flow."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "agent" / "kvtrace"

# Bottom to top. A module's layer is the first prefix that matches its dotted name.
LAYERS = (
    ("kvtrace", "kvtrace.errors", "kvtrace.human", "kvtrace.config", "kvtrace._proto", "kvtrace.model"),
    ("kvtrace.session",),
    ("kvtrace.sources", "kvtrace.analysis"),
    # kvtrace.wire inside: the shared helpers at the bottom, the conversions, then the JSON forms built
    # on them; the package's own __init__ (re-exports) on top, so no wire module imports it.
    ("kvtrace.wire.common",),
    ("kvtrace.wire.events", "kvtrace.wire.columns", "kvtrace.wire.depth", "kvtrace.wire.agent", "kvtrace.wire.vllm",
     "kvtrace.wire.recordings"),
    ("kvtrace.wire.json",),
    ("kvtrace.wire",),
    # What the servers read (backend) and the metrics catalog and collector, below every exporter.
    ("kvtrace.servers.backend", "kvtrace.servers.metrics"),
    ("kvtrace.servers", "kvtrace.client", "kvtrace.reports"),
    ("kvtrace.daemon",),
    ("kvtrace.cli",),
)
# Never importing each other: sources do not read analysis and analysis reads no source (it reads
# the Session); what serves or reports reads the Session and the model, never a source's raw shapes;
# the two metrics exporters share the catalog (servers.metrics), not each other.
APART = (("kvtrace.sources", "kvtrace.analysis"), ("kvtrace.servers", "kvtrace.client"),
         ("kvtrace.servers.prometheus", "kvtrace.servers.otlp"),
         *((reader, "kvtrace.sources") for reader in ("kvtrace.wire", "kvtrace.servers", "kvtrace.client",
                                                       "kvtrace.reports")))


def layer_of(module: str) -> int:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    assert best is not None, module
    return best[0]


def imports() -> list[tuple[str, str]]:
    """(importing module, imported kvtrace module) for every import in the package, also the ones
    inside functions (imported late is still a dependency)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if "_proto" in path.parts:
            continue
        module = ".".join(("kvtrace", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvtrace"):
                found.append((module, node.module))
            elif isinstance(node, ast.Import):
                found += [(module, alias.name) for alias in node.names if alias.name.startswith("kvtrace")]
    return found


def test_no_import_runs_back_up():
    upward = [f"{source} imports {target}" for source, target in imports()
              if layer_of(target) > layer_of(source)]
    assert upward == []


def test_neighbours_that_must_not_know_each_other():
    crossing = [f"{source} imports {target}" for source, target in imports()
                for a, b in APART for x, y in ((a, b), (b, a))
                if (source == x or source.startswith(x + ".")) and (target == y or target.startswith(y + "."))]
    assert crossing == []


# Within servers/api/ (its __init__ says which module holds what) each module imports only the ones
# before it here: what checks requests and what redacts know nothing of the service or its sockets.
API_ORDER = tuple(f"kvtrace.servers.api.{name}"
                  for name in ("requests", "redaction", "peers", "slots", "servicer", "listeners", "server"))


def test_the_api_package_imports_one_way():
    backward = [f"{source} imports {target}" for source, target in imports()
                if source.startswith("kvtrace.servers.api") and target.startswith("kvtrace.servers.api")
                and not (source in API_ORDER and target in API_ORDER
                         and API_ORDER.index(target) < API_ORDER.index(source))]
    assert backward == []


def test_the_bpf_wing_is_below_the_rest_of_sources_and_its_parts_below_its_source():
    """Inside sources/: the shared readers (procfs, elf, python/, ...) never import the BPF wing (discovery and
    usdt live in it), and the BPF source's parts (targets, stack naming, selection) are handed what they need
    rather than importing the source that makes them."""
    bpf = "kvtrace.sources.bpf"
    upward = [f"{source} imports {target}" for source, target in imports()
              if source.startswith("kvtrace.sources.") and not source.startswith(bpf + ".")
              and (target == bpf or target.startswith(bpf + "."))]
    parts = ("targets", "stack_names", "selection")
    circular = [f"{source} imports {target}" for source, target in imports()
                if source in {f"{bpf}.{part}" for part in parts} and target == f"{bpf}.source"]
    assert upward == [] and circular == []
