"""The real agent on a Python workload that leaks from one known function: `kvtrace leaks` and
`kvtrace top` name it.

GIVEN `kvtrace agent` following a Python process that, through the stub libcudart, loads "weights"
once, then for half a minute keeps 1 MiB from `leak()` every half second while `churn()` allocates
and frees 8 MiB,
WHEN `kvtrace leaks --json` asks for suspects at least 1 s old,
THEN the leaking function is the first suspect, growing, with exactly its allocations; the weights
come next, flat; `churn` is no suspect; and `kvtrace top --once` shows the process's traced bytes.
"""
import json
import subprocess
import sys
import textwrap
import time

from agent_process import AgentProcess, kvtrace

MiB = 1 << 20
LEAKS = 60  # one every half second: 30 s, so that the agent samples the site's growth (every 10 s)

TARGET = textwrap.dedent("""
    import ctypes, sys, time

    cudart = ctypes.CDLL(sys.argv[1])
    kept = []

    def malloc(size):
        pointer = ctypes.c_void_p()
        assert cudart.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(size)) == 0
        return pointer

    def load_weights():
        kept.append(malloc(64 << 20))

    def leak():
        kept.append(malloc(1 << 20))

    def churn():
        cudart.cudaFree(malloc(8 << 20))

    print("ready", flush=True)
    sys.stdin.readline()
    load_weights()
    for _ in range({leaks}):
        leak()
        churn()
        time.sleep(0.5)
    print("done", flush=True)
    sys.stdin.readline()
""").format(leaks=LEAKS)


def test_leaks_names_the_leaking_function(tmp_path, bpf_here, stub_build):
    script = tmp_path / "leaky.py"
    script.write_text(TARGET)
    socket = tmp_path / "kvtrace.sock"
    target = subprocess.Popen([sys.executable, str(script), str(stub_build.libcudart)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline().strip() == "ready"
        with AgentProcess(socket, "-p", str(target.pid), "--no-nvml") as agent:
            time.sleep(1.0)  # the agent reads the target's Python runtime before it allocates
            target.stdin.write("go\n")
            target.stdin.flush()
            assert target.stdout.readline().strip() == "done", agent.stderr_text()
            time.sleep(1.5)  # every allocation at least 1 s old
            leaks = kvtrace("leaks", "--socket", str(socket), "--min-age", "1", "--json")
            top = kvtrace("top", "--once", "--socket", str(socket), "--sort", "outstanding")
        assert leaks.returncode == 0, leaks.stderr
        report = json.loads(leaks.stdout)
        first, second = report["suspects"][:2]
        assert [frame["function"] for frame in first["stack"][:2]] == ["malloc", "leak"]  # innermost first
        assert (first["pid"], first["allocation_count"], first["outstanding_bytes"]) == (target.pid, LEAKS,
                                                                                       LEAKS * MiB)
        assert first["growth_bytes_per_second"] > 0
        assert [frame["function"] for frame in second["stack"][:2]] == ["malloc", "load_weights"]
        assert second["growth_bytes_per_second"] == 0.0 and second["outstanding_bytes"] == 64 * MiB
        assert len(report["suspects"]) == 2  # churn's memory is freed: no suspect
        assert report["suspect_allocations"] == LEAKS + 1
        assert top.returncode == 0, top.stderr
        row = next(line for line in top.stdout.splitlines() if line.split()[:1] == [str(target.pid)])
        assert f" {LEAKS + 64:.1f} MiB " in row  # leak + weights: traced physical bytes
        assert "nvml" not in top.stdout  # --no-nvml: no component, not a down one
    finally:
        target.kill()
        target.wait()
