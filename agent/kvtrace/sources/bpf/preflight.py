"""Can this host load our BPF probes? Each check returns one Finding with one actionable line.

`kvtrace doctor` shows every finding; `kvtrace agent` calls `require_tracing()` so that a missing
capability or kernel feature is one clear line and an exit code instead of a bcc traceback.
Every check takes its paths (`root`) and values as parameters so tests can fake the host.
"""
from __future__ import annotations

import gzip
import importlib
import platform
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtrace.errors import CommandError, ExitCode
from kvtrace.sources.procfs import status_field

# Bit numbers from include/uapi/linux/capability.h.
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39

REQUIRED_KERNEL_CONFIG = ("CONFIG_BPF_SYSCALL", "CONFIG_UPROBES", "CONFIG_UPROBE_EVENTS",
                          "CONFIG_BPF_EVENTS")
TRACEFS_DIRS = ("sys/kernel/tracing", "sys/kernel/debug/tracing")
MOUNT_TRACEFS = "mount -t tracefs nodev /sys/kernel/tracing"
GRANT_CAPS = "run as root (sudo kvtrace ...) or grant CAP_BPF,CAP_PERFMON,CAP_SYS_PTRACE"


@dataclass(frozen=True)
class Finding:
    """One check's result. For a problem, `message` is one line that names the fix."""

    name: str
    ok: bool
    message: str
    exit_code: ExitCode = ExitCode.OK
    warning: bool = False  # ok, but something the operator should know (doctor prints `warn`)

    def to_json_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, "warning": self.warning,
                "message": self.message, "exit_code": int(self.exit_code)}


def _problem(name: str, message: str, exit_code: ExitCode) -> Finding:
    return Finding(name, False, message, exit_code)


def effective_capabilities(root: Path = Path("/")) -> int:
    """CapEff of this process as a bit mask; 0 when it cannot be read (assume nothing)."""
    value = status_field("self", "CapEff", root / "proc")
    try:
        return int(value, 16) if value else 0
    except ValueError:
        return 0


def check_permissions(root: Path = Path("/"), uprobe_multi: Callable[[], str] | None = None) -> Finding:
    """`uprobe_multi` says why uprobe_multi links cannot be made here ("" when they can); by default
    the kernel is asked, when `root` is this host's."""
    caps = effective_capabilities(root)
    has = {bit: bool(caps >> bit & 1) for bit in (CAP_SYS_PTRACE, CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF)}
    if has[CAP_SYS_ADMIN]:
        granted = "CAP_SYS_ADMIN"
    elif has[CAP_BPF] and has[CAP_PERFMON]:
        granted = "CAP_BPF+CAP_PERFMON"
        if uprobe_multi is None and root == Path("/"):
            from kvtrace.sources.bpf.links import uprobe_multi_supported

            uprobe_multi = uprobe_multi_supported
        why_not = uprobe_multi() if uprobe_multi is not None else ""
        if why_not:
            # Without uprobe_multi links the probes go in through perf_event_open, which takes
            # CAP_SYS_ADMIN for uprobes since the 2025 fix "perf: Require CAP_SYS_ADMIN for uprobes":
            # with CAP_BPF+CAP_PERFMON alone every attach fails and nothing is traced.
            return _problem("permissions", f"CAP_BPF+CAP_PERFMON, but this kernel cannot take uprobe_multi "
                            f"links ({why_not}) and its perf-event uprobes need CAP_SYS_ADMIN: add it "
                            "(docs/deploy.md says how)", ExitCode.PERMISSION)
    else:
        return _problem("permissions", f"cannot load BPF without privileges: {GRANT_CAPS}",
                        ExitCode.PERMISSION)
    if not has[CAP_SYS_PTRACE]:
        # Probes still load; only reading other processes' memory (Python stack symbols) fails.
        return Finding("permissions", True,
                       f"{granted} but no CAP_SYS_PTRACE: Python stacks of other processes cannot "
                       "be symbolized; run as root or grant CAP_SYS_PTRACE", warning=True)
    return Finding("permissions", True, f"{granted} and CAP_SYS_PTRACE")


def _kernel_config_text(release: str, root: Path) -> tuple[str, str] | None:
    boot = root / "boot" / f"config-{release}"
    if boot.is_file():
        return str(boot), boot.read_text(errors="replace")
    proc = root / "proc/config.gz"
    if proc.is_file():
        try:
            with gzip.open(proc, "rt", errors="replace") as file:
                return str(proc), file.read()
        except (OSError, EOFError):
            return None
    return None


def check_kernel_config(release: str | None = None, root: Path = Path("/")) -> Finding:
    release = release or platform.release()
    found = _kernel_config_text(release, root)
    if found is None:
        # Many distributions ship neither file; the load itself will tell if something is missing.
        return Finding("kernel config", True,
                       f"unknown: no /boot/config-{release} or /proc/config.gz to check")
    source, text = found
    values = dict(re.findall(r"^(CONFIG_\w+)=(\S+)", text, re.MULTILINE))
    missing = [option for option in REQUIRED_KERNEL_CONFIG if values.get(option) != "y"]
    if missing:
        wanted = ", ".join(f"{option}=y" for option in missing)
        return _problem("kernel config",
                        f"kernel {release} lacks {wanted} ({source}): boot a kernel built with them",
                        ExitCode.KERNEL)
    return Finding("kernel config", True, f"BPF and uprobe options are set ({source})")


def check_btf(root: Path = Path("/")) -> Finding:
    # bcc compiles against headers, but kernel struct offsets (thread pointer for Python stacks)
    # are only right when taken from BTF; without it stacks degrade, tracing still works.
    if (root / "sys/kernel/btf/vmlinux").exists():
        return Finding("btf", True, "/sys/kernel/btf/vmlinux is present")
    return Finding("btf", True,
                   "no /sys/kernel/btf/vmlinux: Python stacks are unavailable; boot a kernel built "
                   "with CONFIG_DEBUG_INFO_BTF=y", warning=True)


def check_tracefs(root: Path = Path("/")) -> Finding:
    for directory in TRACEFS_DIRS:
        if (root / directory / "uprobe_events").exists():
            return Finding("tracefs", True, f"/{directory}/uprobe_events is present")
    return _problem("tracefs", f"tracefs is not mounted: run `{MOUNT_TRACEFS}`", ExitCode.KERNEL)


def check_kernel_headers(release: str | None = None, root: Path = Path("/")) -> Finding:
    release = release or platform.release()
    build = root / "lib/modules" / release / "build"
    if build.exists():  # follows the link: a dangling one is as bad as none
        return Finding("kernel headers", True, f"{build} -> {build.resolve()}")
    return _problem("kernel headers",
                    f"no kernel headers for {release}: run `make setup` (installs linux-headers and "
                    f"links /lib/modules/{release}/build)", ExitCode.KERNEL)


def check_bcc(importer: Callable[[str], object] = importlib.import_module) -> Finding:
    try:
        module = importer("bcc")
    except Exception as error:  # a broken install raises more than ImportError (e.g. OSError)
        return _problem("bcc",
                        f"cannot import bcc ({type(error).__name__}: {error}): install python3-bpfcc "
                        "(apt-get install -y python3-bpfcc) and run kvtrace from a virtualenv made "
                        "with --system-site-packages (`make setup` does both)", ExitCode.BCC_MISSING)
    version = getattr(module, "__version__", None)
    label = f"bcc {version}" if version else "bcc"
    return Finding("bcc", True, f"{label} at {getattr(module, '__file__', '?')}")


def uretprobe_seccomp_risk(kernel_release: str) -> bool:
    """True where a uretprobe can kill a seccomp-filtered process.

    6.11 returns from uretprobes through a new `uretprobe` syscall, which a seccomp filter that does
    not know it blocks (systemd issue 34615). 6.14 lets it pass seccomp unfiltered.
    """
    match = re.match(r"(\d+)\.(\d+)", kernel_release)
    if not match:
        return False
    version = (int(match.group(1)), int(match.group(2)))
    return (6, 11) <= version < (6, 14)


def process_has_seccomp_filter(pid: int, root: Path = Path("/")) -> bool:
    """True when the process runs under a seccomp filter (mode 2); False if gone or unreadable."""
    return status_field(pid, "Seccomp", root / "proc") == "2"


def check_uretprobe_seccomp(release: str | None = None) -> Finding:
    release = release or platform.release()
    if uretprobe_seccomp_risk(release):
        return Finding("uretprobe seccomp", True,
                       f"kernel {release} can kill seccomp-filtered processes when a uretprobe "
                       "returns (systemd#34615); the agent skips them: upgrade to 6.14+ to trace "
                       "them", warning=True)
    return Finding("uretprobe seccomp", True, f"kernel {release} is not affected")


def _unchecked(name: str, check: Callable[[], Finding]) -> Finding:
    """The check's finding; where this user may not look (tracefs is root's alone), a warning that
    says so instead of a traceback: what can be checked still is."""
    try:
        return check()
    except OSError as error:
        where = f" on {error.filename}" if error.filename else ""
        return Finding(name, True, f"not checked: {error.strerror or error}{where}; "
                       "run `sudo kvtrace doctor` to check it", warning=True)


def run_checks(release: str | None = None, root: Path = Path("/"),
               importer: Callable[[str], object] = importlib.import_module) -> list[Finding]:
    """Every check, for `kvtrace doctor`; changes nothing on the host. Runs without root too:
    a check it may not make is a warning that names it."""
    release = release or platform.release()
    checks: list[tuple[str, Callable[[], Finding]]] = [
        ("permissions", lambda: check_permissions(root)),
        ("kernel config", lambda: check_kernel_config(release, root)),
        ("btf", lambda: check_btf(root)),
        ("tracefs", lambda: check_tracefs(root)),
        ("kernel headers", lambda: check_kernel_headers(release, root)),
        ("bcc", lambda: check_bcc(importer)),
        ("uretprobe seccomp", lambda: check_uretprobe_seccomp(release)),
    ]
    return [_unchecked(name, check) for name, check in checks]


def _mount_tracefs(root: Path) -> None:
    subprocess.run(["mount", "-t", "tracefs", "nodev", str(root / "sys/kernel/tracing")],
                   check=False, capture_output=True)


def require_tracing(release: str | None = None, root: Path = Path("/"),
                    importer: Callable[[str], object] = importlib.import_module,
                    mount: Callable[[Path], None] = _mount_tracefs) -> None:
    """Raises CommandError with the first problem that would stop the probes from loading.

    Mounts tracefs when it is missing and we may: many VMs boot without it mounted.
    """
    release = release or platform.release()
    checks: list[Callable[[], Finding]] = [
        lambda: check_permissions(root),
        lambda: check_kernel_config(release, root),
        lambda: _tracefs_mounting_if_needed(root, mount),
        lambda: check_kernel_headers(release, root),
        lambda: check_bcc(importer),
    ]
    for check in checks:
        finding = _unchecked("preflight", check)  # what cannot be looked at is left to the load
        if not finding.ok:
            raise CommandError(finding.message, finding.exit_code)


def _tracefs_mounting_if_needed(root: Path, mount: Callable[[Path], None]) -> Finding:
    finding = check_tracefs(root)
    if finding.ok or not effective_capabilities(root) >> CAP_SYS_ADMIN & 1:
        return finding
    mount(root)
    return check_tracefs(root)
