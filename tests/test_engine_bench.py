"""benchmarks/bench_transformer.py keeps running (a smoke run on a tiny model; no timing is asserted)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent


def test_bench_transformer_quick_prints_both_loops():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_transformer.py"), "--quick", "--no-compile",
                          "--iters", "2"], capture_output=True, text=True, timeout=600, check=True).stdout
    assert "torch autocast+GradScaler eager" in out and "ampfunc make_train_step eager" in out
    assert "ampfunc ModuleTrainer (autocast loop) eager" in out


def test_bench_transformer_quick_runs_transformers_gpt2():
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_transformer.py"), "--quick", "--no-compile",
                          "--iters", "2", "--model", "hf-gpt2"], capture_output=True, text=True, timeout=600,
                         check=True).stdout
    assert "model: hf-gpt2" in out and "ampfunc make_train_step.step_ eager" in out
