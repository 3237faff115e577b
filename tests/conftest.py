"""Shared by all test layers: makes tests/harness.py and tests/agent_process.py importable."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
