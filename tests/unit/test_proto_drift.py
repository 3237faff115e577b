"""The committed agent/kvtrace/_proto is exactly what proto/generate.py makes from proto/."""
import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "agent" / "kvtrace" / "_proto"


def generated_files(directory: Path) -> set[str]:
    return {str(path.relative_to(directory)) for path in directory.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts}


def test_generated_code_matches_the_protos(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    fresh, committed = generated_files(tmp_path), generated_files(COMMITTED)
    assert fresh == committed, "run `python proto/generate.py` and commit agent/kvtrace/_proto"
    different = [name for name in sorted(fresh)
                 if not filecmp.cmp(tmp_path / name, COMMITTED / name, shallow=False)]
    assert not different, f"stale generated files {different}: run `python proto/generate.py`"
