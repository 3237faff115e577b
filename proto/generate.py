"""Generates the committed Python code of kvtrace.v1 into agent/kvtrace/_proto.

    python proto/generate.py            # regenerate in place (after editing a .proto)
    python proto/generate.py --out DIR  # generate elsewhere (tests/unit/test_proto_drift.py)

protoc writes `from kvtrace.v1 import events_pb2`; the files live in the package at
kvtrace._proto.kvtrace.v1, so those imports are rewritten to that path. The generated code depends
on the grpcio-tools version (it checks the runtime against it), so that version is pinned.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = PROTO_ROOT.parent / "agent" / "kvtrace" / "_proto"
PACKAGE = "kvtrace._proto"
# The generated code refuses runtimes older than its generator (grpcio, protobuf): generate with
# the oldest tools that fit our runtimes. Keep equal to the pin in pyproject's `test` extra.
GRPCIO_TOOLS_VERSION = "1.76.0"

_IMPORT = re.compile(r"^from kvtrace\.v1 import ", re.MULTILINE)
_PACKAGE_DOC = '"""Generated from proto/ by proto/generate.py; never edit by hand."""\n'


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("kvtrace/**/*.proto"))


def generate(out: Path) -> list[Path]:
    """Writes the generated package under `out` and returns the files written."""
    from importlib.metadata import version

    from grpc_tools import protoc  # the `test` extra; the agent itself never needs it

    if version("grpcio-tools") != GRPCIO_TOOLS_VERSION:
        raise SystemExit(f"generate with grpcio-tools=={GRPCIO_TOOLS_VERSION} (installed: "
                         f"{version('grpcio-tools')}): pip install -e '.[test]'")
    out.mkdir(parents=True, exist_ok=True)
    sources = [str(path.relative_to(PROTO_ROOT)) for path in proto_files()]
    status = protoc.main([
        "grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={out}", f"--pyi_out={out}",
        f"--grpc_python_out={out}", *sources])
    if status != 0:
        raise SystemExit(f"protoc failed with status {status}")
    written = []
    for path in sorted(out.glob("kvtrace/**/*.py*")):
        text = _IMPORT.sub(f"from {PACKAGE}.kvtrace.v1 import ", path.read_text())
        path.write_text(text)
        written.append(path)
    packages = [out, *(path for path in out.rglob("*") if path.is_dir() and path.name != "__pycache__")]
    for package in packages:
        init = package / "__init__.py"
        init.write_text(_PACKAGE_DOC)
        written.append(init)
    return sorted(set(written))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
