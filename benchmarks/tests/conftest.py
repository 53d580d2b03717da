"""The lab's tests: the tools under benchmarks/tools import as top-level modules, this checkout's
distlm first, one intra-op thread as in the product's suite (tests/conftest.py says why)."""
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "tools")]
