"""Discovery's rescans: what a process maps is read from its maps' executable lines, and a mapped file
found to offer nothing is not looked at again (a rescan of a process costs no stat of it)."""
from __future__ import annotations

import os
from pathlib import Path

from kvtrace.sources import procfs
from kvtrace.sources.bpf import discovery as discovery_module
from kvtrace.sources.bpf.discovery import Discovery, FileId, executable_mappings


def maps_line(start: int, perms: str, path: Path) -> str:
    st = os.stat(path)
    return (f"{start:x}-{start + 0x1000:x} {perms} 00000000 {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} "
            f"{st.st_ino} {path}")


def fake_proc(tmp_path: Path, pid: int, files: list[tuple[str, Path]]) -> Path:
    """/proc with one process whose root is / (the files' real paths) and whose maps are `files`."""
    proc = tmp_path / "proc"
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    if not (proc / str(pid) / "root").exists():
        (proc / str(pid) / "root").symlink_to("/")
    (proc / str(pid) / "maps").write_text(
        "\n".join(maps_line(0x7F0000000000 + index * 0x10000, perms, path)
                  for index, (perms, path) in enumerate(files)) + "\n")
    return proc


def test_only_executable_file_backed_lines_are_parsed(tmp_path):
    text, data = tmp_path / "libtext.so", tmp_path / "libdata.so"
    text.write_bytes(b"not an ELF")
    data.write_bytes(b"not an ELF either")
    proc = fake_proc(tmp_path, 42, [("r--p", text), ("r-xp", text), ("rw-p", data), ("r--p", data)])
    (proc / "42" / "maps").write_text((proc / "42" / "maps").read_text()
                                      + "7ffd00000000-7ffd00021000 rwxp 00000000 00:00 0 [stack]\n")
    st = os.stat(text)
    assert list(executable_mappings(42, proc)) == [FileId(st.st_dev, st.st_ino)]
    every = procfs.read_maps(42, proc)
    only = procfs.read_maps(42, proc, executable_only=True)
    assert [m.perms for m in every] == ["r--p", "r-xp", "rw-p", "r--p", "rwxp"]
    assert only == [m for m in every if m.executable]


def test_a_mapped_file_with_nothing_to_probe_is_looked_at_once_per_process(tmp_path, monkeypatch):
    plain = tmp_path / "libplain.so"
    plain.write_bytes(b"\x7fELF but nothing CUDA in it")
    proc = fake_proc(tmp_path, 42, [("r-xp", plain)])
    fake_proc(tmp_path, 43, [("r-xp", plain)])
    stats = []
    real_stat = os.stat

    def counted(path, *args, **kwargs):
        stats.append(str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(discovery_module.os, "stat", counted)
    found = Discovery(proc)
    # GIVEN a first scan that looked at the file (its verdict: nothing to probe)
    assert found.scan_pid(42) == []
    assert stats
    # WHEN the process is scanned again, THEN no stat of it
    stats.clear()
    assert found.scan_pid(42) == []
    assert stats == []
    # AND another process that maps it looks at it once (its inode could be another file's, reused)
    assert found.scan_pid(43) == []
    assert stats
    stats.clear()
    assert found.scan_pid(43) == []
    assert stats == []
    # AND a file put in its place (a new inode: pip, a package manager) is looked at
    replacement = tmp_path / "libplain.so.new"
    replacement.write_bytes(b"\x7fELF another one")
    replacement.replace(plain)
    fake_proc(tmp_path, 42, [("r-xp", plain)])
    stats.clear()
    assert found.scan_pid(42) == []
    assert any(path.endswith("libplain.so") for path in stats)


def test_what_a_process_no_longer_maps_or_a_process_gone_is_forgotten(tmp_path):
    plain, other = tmp_path / "libplain.so", tmp_path / "libother.so"
    plain.write_bytes(b"nothing")
    other.write_bytes(b"nothing either")
    proc = fake_proc(tmp_path, 42, [("r-xp", plain), ("r-xp", other)])
    fake_proc(tmp_path, 43, [("r-xp", plain)])
    found = Discovery(proc)
    found.scan_pid(42)
    found.scan_pid(43)
    assert {pid: len(files) for pid, files in found._not_targets.items()} == {42: 2, 43: 1}
    fake_proc(tmp_path, 42, [("r-xp", plain)])  # 42 unmapped libother
    found.scan_pid(42)
    assert {path for _, path in found._not_targets[42]} == {str(plain)}
    found.forget_other_pids({42})  # a full scan found only 42
    assert set(found._not_targets) == {42}
    found.forget_pid(42)
    assert found._not_targets == {}


def test_a_file_that_cannot_be_looked_at_now_is_looked_at_again(tmp_path, monkeypatch):
    plain = tmp_path / "libplain.so"
    plain.write_bytes(b"nothing")
    proc = fake_proc(tmp_path, 42, [("r-xp", plain)])
    found = Discovery(proc)
    monkeypatch.setattr(found, "_verdict", lambda file_id, path: None)  # a stat that failed in a race
    found.scan_pid(42)
    assert not found._not_targets[42]
    monkeypatch.undo()
    found.scan_pid(42)
    assert len(found._not_targets[42]) == 1
