"""The benchmark script keeps running (a smoke run on a tiny tree; no timing is asserted)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent


def test_bench_step_quick_prints_every_section():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--quick", "--reps", "1"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    for section in ("floor:", "(a)", "(b)", "(c)", "(d)", "(g)"):
        assert section in out, f"benchmark output lacks section {section}"
