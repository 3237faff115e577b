"""Preflight checks and `kvtrace doctor` against fake host roots: no root, no bcc needed."""
import gzip
import json
import sys
import types
from pathlib import Path

import pytest

from kvtrace.cli.doctor import DoctorCommand
from kvtrace.cli.main import main
from kvtrace.errors import CommandError, ExitCode
from kvtrace.sources.bpf import preflight
from kvtrace.sources.bpf.preflight import Finding

RELEASE = "6.18.44-fc-v657"
ROOT_CAPS = 0x1fffeffffff  # this machine's root: everything but CAP_SYS_RESOURCE
GOOD_CONFIG = "CONFIG_BPF_SYSCALL=y\nCONFIG_UPROBES=y\nCONFIG_UPROBE_EVENTS=y\nCONFIG_BPF_EVENTS=y\n"


def caps(*bits):
    return sum(1 << bit for bit in bits)


def write(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def fake_host(root: Path, cap_eff=ROOT_CAPS, config=GOOD_CONFIG, tracefs=True, headers=True,
              btf=True) -> Path:
    """A host that can trace, with each piece removable."""
    write(root / "proc/self/status", f"Name:\tpython3\nCapInh:\t0\nCapEff:\t{cap_eff:016x}\n")
    if config is not None:
        write(root / "boot" / f"config-{RELEASE}", config)
    if tracefs:
        write(root / "sys/kernel/tracing/uprobe_events")
    if btf:
        write(root / "sys/kernel/btf/vmlinux")
    if headers:
        (root / "usr/src/linux-headers").mkdir(parents=True)
        (root / "lib/modules" / RELEASE).mkdir(parents=True)
        (root / "lib/modules" / RELEASE / "build").symlink_to(root / "usr/src/linux-headers")
    return root


def bcc_ok(name):
    return types.SimpleNamespace(__version__="0.26.0", __file__="/fake/bcc/__init__.py")


def bcc_missing(name):
    raise ModuleNotFoundError("No module named 'bcc'")


# --- permissions ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bits, ok, warning", [
    ((preflight.CAP_SYS_ADMIN, preflight.CAP_SYS_PTRACE), True, False),
    ((preflight.CAP_BPF, preflight.CAP_PERFMON, preflight.CAP_SYS_PTRACE), True, False),
    ((preflight.CAP_BPF, preflight.CAP_PERFMON), True, True),  # loads, but no foreign stacks
    ((preflight.CAP_SYS_ADMIN,), True, True),
    ((preflight.CAP_BPF, preflight.CAP_SYS_PTRACE), False, False),  # CAP_PERFMON missing
    ((preflight.CAP_PERFMON,), False, False),
    ((), False, False),
])
def test_permissions_from_cap_eff(tmp_path, bits, ok, warning):
    fake_host(tmp_path, cap_eff=caps(*bits))
    finding = preflight.check_permissions(tmp_path)
    assert (finding.ok, finding.warning) == (ok, warning)
    if not ok:
        assert finding.exit_code == ExitCode.PERMISSION
        assert "sudo kvtrace" in finding.message
        assert "CAP_BPF,CAP_PERFMON,CAP_SYS_PTRACE" in finding.message


def test_permissions_real_root_mask(tmp_path):
    fake_host(tmp_path)
    assert preflight.check_permissions(tmp_path) == Finding(
        "permissions", True, "CAP_SYS_ADMIN and CAP_SYS_PTRACE")


def test_unreadable_status_means_no_capabilities(tmp_path):
    assert preflight.effective_capabilities(tmp_path) == 0
    assert preflight.check_permissions(tmp_path).exit_code == ExitCode.PERMISSION


# --- kernel config -------------------------------------------------------------------------------

def test_kernel_config_all_set(tmp_path):
    fake_host(tmp_path)
    finding = preflight.check_kernel_config(RELEASE, tmp_path)
    assert finding.ok and f"config-{RELEASE}" in finding.message


def test_kernel_config_missing_option(tmp_path):
    config = GOOD_CONFIG.replace("CONFIG_UPROBE_EVENTS=y", "# CONFIG_UPROBE_EVENTS is not set")
    fake_host(tmp_path, config=config.replace("CONFIG_BPF_EVENTS=y", "CONFIG_BPF_EVENTS=m"))
    finding = preflight.check_kernel_config(RELEASE, tmp_path)
    assert not finding.ok
    assert finding.exit_code == ExitCode.KERNEL
    assert "CONFIG_UPROBE_EVENTS=y, CONFIG_BPF_EVENTS=y" in finding.message
    assert "CONFIG_UPROBES=y" not in finding.message


def test_kernel_config_from_proc_config_gz(tmp_path):
    fake_host(tmp_path, config=None)
    with gzip.open(tmp_path / "proc/config.gz", "wt") as file:
        file.write(GOOD_CONFIG.replace("CONFIG_UPROBES=y", "CONFIG_UPROBES=n"))
    finding = preflight.check_kernel_config(RELEASE, tmp_path)
    assert not finding.ok and "CONFIG_UPROBES=y" in finding.message
    assert "/proc/config.gz" in finding.message


def test_kernel_config_unknown_is_ok_with_note(tmp_path):
    fake_host(tmp_path, config=None)
    finding = preflight.check_kernel_config(RELEASE, tmp_path)
    assert finding.ok and finding.message.startswith("unknown")


# --- btf, tracefs, headers, bcc ------------------------------------------------------------------

def test_btf_absent_is_a_warning(tmp_path):
    assert preflight.check_btf(fake_host(tmp_path)) == Finding(
        "btf", True, "/sys/kernel/btf/vmlinux is present")
    finding = preflight.check_btf(fake_host(tmp_path / "nobtf", btf=False))
    assert finding.ok and finding.warning and "CONFIG_DEBUG_INFO_BTF" in finding.message


def test_tracefs_missing(tmp_path):
    finding = preflight.check_tracefs(fake_host(tmp_path, tracefs=False))
    assert not finding.ok
    assert finding.exit_code == ExitCode.KERNEL
    assert finding.message == ("tracefs is not mounted: run "
                               "`mount -t tracefs nodev /sys/kernel/tracing`")


def test_tracefs_under_debugfs_is_enough(tmp_path):
    fake_host(tmp_path, tracefs=False)
    write(tmp_path / "sys/kernel/debug/tracing/uprobe_events")
    assert preflight.check_tracefs(tmp_path).ok


def test_kernel_headers_missing_or_dangling(tmp_path):
    assert preflight.check_kernel_headers(RELEASE, fake_host(tmp_path / "good")).ok
    missing = preflight.check_kernel_headers(RELEASE, fake_host(tmp_path / "none", headers=False))
    assert not missing.ok and missing.exit_code == ExitCode.KERNEL
    assert missing.message == (f"no kernel headers for {RELEASE}: run `make setup` (installs "
                               f"linux-headers and links /lib/modules/{RELEASE}/build)")
    dangling = fake_host(tmp_path / "dangling", headers=False)
    (dangling / "lib/modules" / RELEASE).mkdir(parents=True)
    (dangling / "lib/modules" / RELEASE / "build").symlink_to(dangling / "usr/src/gone")
    assert preflight.check_kernel_headers(RELEASE, dangling) == missing


def test_bcc_import_failing_via_sys_modules(monkeypatch):
    monkeypatch.setitem(sys.modules, "bcc", None)  # makes `import bcc` raise ImportError
    finding = preflight.check_bcc()
    assert not finding.ok
    assert finding.exit_code == ExitCode.BCC_MISSING
    assert "apt-get install -y python3-bpfcc" in finding.message
    assert "--system-site-packages" in finding.message


def test_bcc_broken_install_is_reported_not_raised():
    def broken(name):
        raise OSError("libbcc.so.0: cannot open shared object file")
    finding = preflight.check_bcc(broken)
    assert finding.exit_code == ExitCode.BCC_MISSING and "libbcc.so.0" in finding.message


def test_bcc_present(monkeypatch):
    monkeypatch.setitem(sys.modules, "bcc", types.ModuleType("bcc"))
    assert preflight.check_bcc().ok
    assert preflight.check_bcc(bcc_ok).message == "bcc 0.26.0 at /fake/bcc/__init__.py"


# --- uretprobe + seccomp -------------------------------------------------------------------------

@pytest.mark.parametrize("release, risk", [
    ("6.10.0", False), ("6.11.2-foo", True), ("6.13.9", True), ("6.14.0", False),
    (RELEASE, False), ("5.15.0-105-generic", False), ("7.0.0", False), ("garbage", False),
])
def test_uretprobe_seccomp_risk(release, risk):
    assert preflight.uretprobe_seccomp_risk(release) is risk


def test_uretprobe_seccomp_finding_is_only_a_warning():
    risky = preflight.check_uretprobe_seccomp("6.12.1")
    assert risky.ok and risky.warning and "6.14" in risky.message
    assert not preflight.check_uretprobe_seccomp("6.14.0").warning


@pytest.mark.parametrize("mode, filtered", [("0", False), ("1", False), ("2", True)])
def test_process_has_seccomp_filter(tmp_path, mode, filtered):
    write(tmp_path / "proc/4242/status", f"Name:\tvllm\nSeccomp:\t{mode}\nSeccomp_filters:\t1\n")
    assert preflight.process_has_seccomp_filter(4242, tmp_path) is filtered


def test_seccomp_of_exited_process_is_false(tmp_path):
    assert preflight.process_has_seccomp_filter(4242, tmp_path) is False


# --- run_checks / require_tracing ----------------------------------------------------------------

def test_run_checks_on_a_good_host(tmp_path):
    findings = preflight.run_checks(RELEASE, fake_host(tmp_path), bcc_ok)
    assert [f.name for f in findings] == ["permissions", "kernel config", "btf", "tracefs",
                                          "kernel headers", "bcc", "uretprobe seccomp"]
    assert all(f.ok and not f.warning for f in findings)
    preflight.require_tracing(RELEASE, tmp_path, bcc_ok)  # does not raise


def test_require_tracing_raises_the_first_problem(tmp_path):
    # Not root *and* no headers *and* no bcc: the permission problem is the one reported.
    fake_host(tmp_path, cap_eff=0, headers=False)
    with pytest.raises(CommandError) as error:
        preflight.require_tracing(RELEASE, tmp_path, bcc_missing)
    assert error.value.exit_code == ExitCode.PERMISSION
    fake_host(tmp_path / "root", headers=False)
    with pytest.raises(CommandError) as error:
        preflight.require_tracing(RELEASE, tmp_path / "root", bcc_missing)
    assert error.value.exit_code == ExitCode.KERNEL
    assert str(error.value).startswith("no kernel headers")


def test_require_tracing_ignores_warnings(tmp_path):
    fake_host(tmp_path, btf=False, config=None)
    preflight.require_tracing(RELEASE, tmp_path, bcc_ok)


def test_require_tracing_mounts_tracefs_as_root(tmp_path):
    fake_host(tmp_path, tracefs=False)
    mounted = []

    def mount(root):
        mounted.append(root)
        write(root / "sys/kernel/tracing/uprobe_events")
    preflight.require_tracing(RELEASE, tmp_path, bcc_ok, mount=mount)
    assert mounted == [tmp_path]


def test_require_tracing_reports_tracefs_when_mount_fails(tmp_path):
    fake_host(tmp_path, tracefs=False)
    with pytest.raises(CommandError) as error:
        preflight.require_tracing(RELEASE, tmp_path, bcc_ok, mount=lambda root: None)
    assert error.value.exit_code == ExitCode.KERNEL
    assert "mount -t tracefs nodev /sys/kernel/tracing" in str(error.value)


def test_require_tracing_does_not_mount_without_cap_sys_admin(tmp_path):
    fake_host(tmp_path, tracefs=False, cap_eff=caps(preflight.CAP_BPF, preflight.CAP_PERFMON))
    mounted = []
    with pytest.raises(CommandError):
        preflight.require_tracing(RELEASE, tmp_path, bcc_ok, mount=mounted.append)
    assert mounted == []


# --- kvtrace doctor ------------------------------------------------------------------------------

GOOD = [Finding("permissions", True, "CAP_SYS_ADMIN and CAP_SYS_PTRACE"),
        Finding("btf", True, "no BTF", warning=True)]
BAD = GOOD + [Finding("tracefs", False, "tracefs is not mounted: run `mount ...`", ExitCode.KERNEL),
              Finding("bcc", False, "cannot import bcc", ExitCode.BCC_MISSING)]


@pytest.fixture
def findings(monkeypatch):
    def use(result):
        monkeypatch.setattr(preflight, "run_checks", lambda: result)
    return use


def test_doctor_all_ok_exits_zero(findings, capsys):
    findings(GOOD)
    assert main(["doctor"]) == ExitCode.OK
    assert capsys.readouterr().out.splitlines() == [
        "ok    permissions: CAP_SYS_ADMIN and CAP_SYS_PTRACE",
        "warn  btf: no BTF",
    ]


def test_doctor_exits_with_first_problem(findings, capsys):
    findings(BAD)
    assert main(["doctor"]) == ExitCode.KERNEL
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:] == ["FAIL  tracefs: tracefs is not mounted: run `mount ...`",
                         "FAIL  bcc: cannot import bcc"]


def test_doctor_json(findings, capsys):
    findings(BAD)
    assert main(["doctor", "--json"]) == ExitCode.KERNEL
    out = json.loads(capsys.readouterr().out)
    assert [item["name"] for item in out] == ["permissions", "btf", "tracefs", "bcc"]
    assert out[1] == {"name": "btf", "ok": True, "warning": True, "message": "no BTF",
                      "exit_code": 0}
    assert out[3]["exit_code"] == ExitCode.BCC_MISSING


def test_doctor_command_directly(findings, capsys):
    findings(BAD[2:3])
    args = types.SimpleNamespace(json=False, pid=None)
    assert DoctorCommand().run(args) == ExitCode.KERNEL
    assert "Check that this host can run the kvtrace agent" in DoctorCommand.__doc__


def test_doctor_on_this_host_runs_without_root_or_bcc(capsys):
    # The real checks must never raise, whatever this host lacks.
    code = main(["doctor"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 7
    assert all(line.split()[0] in ("ok", "warn", "FAIL") for line in lines)
    assert code in (ExitCode.OK, ExitCode.PERMISSION, ExitCode.KERNEL, ExitCode.BCC_MISSING)


def test_bpf_and_perfmon_are_not_enough_without_uprobe_multi_links(tmp_path):
    # Kernels before 6.6 attach through perf_event_open, which needs CAP_SYS_ADMIN for uprobes.
    fake_host(tmp_path, cap_eff=caps(preflight.CAP_BPF, preflight.CAP_PERFMON, preflight.CAP_SYS_PTRACE))
    finding = preflight.check_permissions(tmp_path, uprobe_multi=lambda: "EINVAL: no uprobe_multi (Linux < 6.6)")
    assert not finding.ok and finding.exit_code == ExitCode.PERMISSION
    assert "CAP_SYS_ADMIN" in finding.message and "EINVAL" in finding.message
    assert preflight.check_permissions(tmp_path, uprobe_multi=lambda: "").ok
