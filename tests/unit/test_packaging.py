"""The packaging holds its promises: the systemd unit is hardened, the DaemonSet asks for the same
few capabilities and nothing privileged, and the image is built from the wheel.

GIVEN the files under packaging/, WHEN they are parsed as systemd, Kubernetes and Docker read them,
THEN every privilege is one of the few the agent needs, and both deployments name the same ones.
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "packaging/systemd/kvtrace.service"
DAEMONSET = ROOT / "packaging/k8s/kvtrace-daemonset.yaml"
DOCKERFILE = ROOT / "packaging/docker/Dockerfile"

# What the agent may hold (docs/deploy.md says what each is for). CAP_SYS_ADMIN is not here: it is
# an operator's addition for kernels older than 6.6, never the default.
ALLOWED_CAPABILITIES = {"CAP_BPF", "CAP_PERFMON", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"}
# Host paths the DaemonSet may mount, and the only one it may write to.
ALLOWED_HOST_PATHS = {"/sys/kernel/tracing", "/sys/kernel/btf", "/lib/modules", "/usr/src", "/run/kvtrace",
                      "/run/kvtrace-vllm", "/run/kvtrace-cupti", "/var/lib/kvtrace"}
# The sockets' directories, and the flight recorder's dumps (which must outlive the pod).
WRITABLE_HOST_PATHS = {"/run/kvtrace", "/run/kvtrace-vllm", "/run/kvtrace-cupti", "/var/lib/kvtrace"}


def read_unit(path: Path = UNIT) -> dict[str, dict[str, list[str]]]:
    """section -> key -> every value assigned, in order (systemd allows a key more than once)."""
    sections: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = sections.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"{path}: {line!r} before any [section]"
        key, separator, value = line.partition("=")
        assert separator, f"{path}: not KEY=VALUE: {line!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return sections


def service() -> dict[str, list[str]]:
    return read_unit()["Service"]


def value(key: str) -> str:
    values = service().get(key)
    assert values, f"[Service] has no {key}="
    return values[-1]


def unit_capabilities() -> set[str]:
    return {name for assignment in service()["CapabilityBoundingSet"] for name in assignment.split()}


def documents() -> list[dict]:
    return [document for document in yaml.safe_load_all(DAEMONSET.read_text()) if document]


def daemonset() -> dict:
    (found,) = [document for document in documents() if document["kind"] == "DaemonSet"]
    return found


def pod_spec() -> dict:
    return daemonset()["spec"]["template"]["spec"]


def agent_container() -> dict:
    (container,) = pod_spec()["containers"]
    return container


# ---- systemd ----

def test_unit_grants_only_the_capabilities_the_agent_needs():
    assert unit_capabilities() == ALLOWED_CAPABILITIES
    # root keeps its bounding set; ambient capabilities would add nothing but confusion
    assert service().get("AmbientCapabilities", [""]) == [""]


@pytest.mark.parametrize(("key", "expected"), [
    ("NoNewPrivileges", "yes"),
    ("ProtectSystem", "strict"),
    ("ProtectHome", "read-only"),
    ("PrivateTmp", "yes"),
    ("PrivateMounts", "yes"),
    ("ProtectKernelTunables", "yes"),
    ("ProtectKernelLogs", "yes"),
    ("ProtectControlGroups", "yes"),
    ("ProtectClock", "yes"),
    ("ProtectHostname", "yes"),
    ("RestrictNamespaces", "yes"),
    ("RestrictRealtime", "yes"),
    ("RestrictSUIDSGID", "yes"),
    ("LockPersonality", "yes"),
    ("SystemCallArchitectures", "native"),
    ("SystemCallErrorNumber", "EPERM"),
    ("DevicePolicy", "closed"),
    ("LimitMEMLOCK", "infinity"),
    ("RuntimeDirectory", "kvtrace"),
    ("RuntimeDirectoryMode", "0750"),
    ("ReadWritePaths", "/run/kvtrace-vllm"),
    ("ReadWritePaths", "/run/kvtrace-cupti"),
    ("StateDirectory", "kvtrace"),  # the flight recorder's dumps, kept across restarts
    ("StateDirectoryMode", "0700"),
    ("ExecStartPre", "+/usr/bin/install -d -m 0755 /run/kvtrace-vllm"),
    ("ExecStartPre", "+/usr/bin/install -d -m 0755 /run/kvtrace-cupti"),
    ("Group", "kvtrace"),
    ("UMask", "0077"),
    ("Restart", "on-failure"),
])
def test_unit_hardening(key, expected):
    if key in ("ReadWritePaths", "ExecStartPre"):  # lists: each line adds one
        assert expected in service().get(key, [])
    else:
        assert value(key) == expected


def test_unit_keeps_out_what_would_break_tracing():
    # /lib/modules holds bcc's kernel headers; /dev/nvidia* is NVML; BPF needs the init user
    # namespace; the processes' /proc entries are the agent's input.
    for key in ("ProtectKernelModules", "PrivateDevices", "PrivateUsers", "ProtectProc", "ProcSubset",
                "MemoryDenyWriteExecute", "PrivateNetwork"):
        assert key not in service(), f"{key}= breaks the agent (see the unit's comment)"
    assert service()["DeviceAllow"] == ["char-nvidia* rw"]


def test_unit_allows_the_tracing_calls_and_the_service_set_only():
    assert service()["SystemCallFilter"] == ["@system-service bpf perf_event_open"]
    assert set(value("RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}


def test_unit_is_bounded():
    assert re.fullmatch(r"\d+[KMG]", value("MemoryMax")), value("MemoryMax")
    assert re.fullmatch(r"\d+", value("TasksMax"))
    assert value("CPUQuota").endswith("%")
    # the agent stops within 2 s (tests/integration/test_stop.py): a stop timeout well below
    # systemd's default 90 s, but with room
    assert 2 < int(value("TimeoutStopSec")) <= 30
    unit = read_unit()["Unit"]
    assert int(unit["StartLimitBurst"][-1]) > 0 and int(unit["StartLimitIntervalSec"][-1]) > 0


def test_unit_every_option_says_why():
    """Each [Service] assignment sits under a comment (one may cover a group of lines)."""
    lines = UNIT.read_text().splitlines()
    start = lines.index("[Service]")
    end = lines.index("[Install]")
    uncommented, block_has_comment = [], False
    for line in lines[start + 1:end]:
        if not line.strip():
            block_has_comment = False
        elif line.startswith("#"):
            block_has_comment = True
        elif not block_has_comment:
            uncommented.append(line)
    assert not uncommented, f"options without a comment saying why: {uncommented}"


def test_systemd_analyze_verifies_the_unit(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here: the unit is checked by the parser tests only")
    # verify wants ExecStart to exist; /opt/kvtrace is only there on an installed host
    text = UNIT.read_text().replace("ExecStart=/opt/kvtrace/.venv/bin/kvtrace", f"ExecStart={shutil.which('true')}")
    unit = tmp_path / "kvtrace.service"
    unit.write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                            timeout=60)
    # verify exits 0 on unknown keys and bad values but says so on stderr: both must be clean
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


# ---- Kubernetes ----

def test_daemonset_is_not_privileged_anywhere():
    def walk(node):
        if isinstance(node, dict):
            assert node.get("privileged") is not True, node
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    for document in documents():
        walk(document)


def test_daemonset_adds_exactly_the_units_capabilities():
    capabilities = agent_container()["securityContext"]["capabilities"]
    assert capabilities["drop"] == ["ALL"]
    added = {f"CAP_{name}" for name in capabilities["add"]}
    assert len(capabilities["add"]) == len(added)
    assert added == unit_capabilities()  # one set, two files


def test_daemonset_security_context():
    security = agent_container()["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["appArmorProfile"] == {"type": "Unconfined"}  # ptrace reads of other profiles
    spec = pod_spec()
    assert spec["hostPID"] is True
    assert not spec.get("hostNetwork") and not spec.get("hostIPC")
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["seccompProfile"]["type"] in ("RuntimeDefault", "Unconfined")


def test_daemonset_mounts_only_the_host_paths_it_needs():
    spec = pod_spec()
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    mounts = agent_container()["volumeMounts"]
    host_mounts = {mount["name"]: mount for mount in mounts if "hostPath" in volumes[mount["name"]]}
    for name, mount in host_mounts.items():
        path = volumes[name]["hostPath"]["path"]
        assert path in ALLOWED_HOST_PATHS, f"hostPath {path} is not one the agent needs"
        if path not in WRITABLE_HOST_PATHS:
            assert mount.get("readOnly") is True, f"hostPath {path} must be mounted read-only"
    assert {volumes[name]["hostPath"]["path"] for name in host_mounts} >= {
        "/sys/kernel/tracing", "/lib/modules", "/usr/src", "/run/kvtrace"}
    # every other volume is scratch space, never the host
    for name, volume in volumes.items():
        assert "hostPath" in volume or "emptyDir" in volume, f"volume {name}: {volume}"


def test_daemonset_has_limits_probes_and_its_identity():
    container = agent_container()
    assert {"cpu", "memory"} <= container["resources"]["limits"].keys()
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert probe in container, probe
    env = {item["name"]: item for item in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_daemonset_namespace_admits_it():
    (namespace,) = [document for document in documents() if document["kind"] == "Namespace"]
    assert daemonset()["metadata"]["namespace"] == namespace["metadata"]["name"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


# ---- Docker ----

def dockerfile_stages() -> list[tuple[str, list[str]]]:
    """(FROM line, instructions) per stage; continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append((line, []))
        else:
            assert stages, f"instruction before FROM: {line!r}"
            stages[-1][1].append(line)
    return stages


def test_image_is_built_from_the_wheel():
    stages = dockerfile_stages()
    assert len(stages) >= 2, "a build stage for the wheel and a runtime stage"
    (first_from, first), (_, final) = stages[0], stages[-1]
    build_name = first_from.split()[-1]
    assert re.search(r"\bAS\s+\w+", first_from, re.IGNORECASE)
    assert any(re.search(r"pip wheel .*--no-deps|python3? -m build", line) for line in first)
    copies = [line for line in final if line.upper().startswith("COPY")]
    assert any(f"--from={build_name}" in line and ".whl" in line for line in copies), copies
    installs = [line for line in final if "pip install" in line]
    assert installs and all(".whl" in line for line in installs), installs
    # the final stage never sees the source tree
    assert not any(re.search(r"pip install [^&]*(\s\.(\s|$)|/src\b)", line) for line in installs), installs
    assert not any(line.upper().startswith("COPY") and "--from=" not in line for line in final), copies


def test_image_runs_the_agent_with_bcc_from_the_distribution():
    _, final = dockerfile_stages()[-1]
    text = "\n".join(final)
    assert "python3-bpfcc" in text and "--system-site-packages" in text
    (entrypoint,) = [line for line in final if line.upper().startswith("ENTRYPOINT")]
    assert entrypoint.endswith('"kvtrace", "agent"]') or entrypoint.endswith('/kvtrace", "agent"]'), entrypoint
