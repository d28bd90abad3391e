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


def test_bench_lowmem_gpt_quick_prints_every_row():
    """The GPT-style comparison of the low-memory states runs and prints its rows; a peer
    (torchao, bitsandbytes) that is not installed is a skipped row, not a failure."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_lowmem_gpt.py"), "--quick", "--iters", "2"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = ("fp32-master", "split ", "split+bf16", "split+q8", "compat torch_optim.AdamW split+q8",
            "torch AdamW(fused) fp32 + autocast")
    for name in rows:
        line = next((ln for ln in out.splitlines() if ln.startswith(name)), None)
        assert line is not None, f"benchmark output lacks the row {name!r}:\n{out}"
        assert "FAILED" not in line, line
    for peer in ("torchao AdamW8bit", "bitsandbytes AdamW8bit"):
        line = next((ln for ln in out.splitlines() if ln.startswith(peer)), None)
        assert line is not None, f"benchmark output lacks the peer row {peer!r} (timed or skipped):\n{out}"
