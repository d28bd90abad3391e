"""The two main jobs end to end on short settings, every configuration, with --metrics and --plot."""

import json

import pytest
import torch

from ampfunc.examples import common, digits, textlm

KEYS = {"config", "step", "loss", "loss_scale", "finite", "skipped"}


def check_outputs(rows, metrics_path, plot_path, steps_per_config):
    import matplotlib.image

    names = [r["config"] for r in rows]
    assert names == list(common.CONFIGS)
    lines = [json.loads(line) for line in open(metrics_path)]
    assert all(KEYS <= set(line) for line in lines)
    for name in names:
        mine = [line for line in lines if line["config"] == name]
        assert [m["step"] for m in mine] == list(range(steps_per_config))  # every step, in order
        assert all(isinstance(m["loss"], float) and m["finite"] in (True, False) for m in mine)
        assert mine[-1]["skipped"] == next(r for r in rows if r["config"] == name)["skipped"]
    scaled = [line["loss_scale"] for line in lines if line["config"] == "fp16+dynamic"]
    assert scaled[0] == 2.0 ** 16 and all(line["loss_scale"] == 1.0 for line in lines if line["config"] == "fp32")
    image = matplotlib.image.imread(plot_path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_digits_every_config_with_metrics_and_plot(tmp_path, capsys):
    m, p = tmp_path / "m.jsonl", tmp_path / "p.png"
    rows = digits.main(["--epochs", "1", "--batch", "256", "--log-every", "2", "--metrics", str(m), "--plot", str(p),
                        "--no-progress"])
    check_outputs(rows, m, p, steps_per_config=5)
    out = capsys.readouterr().out
    assert "| fp16 unscaled |" in out and "plot:" in out
    assert all(r["test acc"] > 0.3 for r in rows)  # five steps already learn something


def test_textlm_every_config_with_metrics_and_plot(tmp_path, capsys):
    m, p = tmp_path / "m.jsonl", tmp_path / "p.png"
    rows = textlm.main(["--steps", "6", "--batch", "4", "--context", "16", "--width", "32", "--layers", "1",
                        "--log-every", "4", "--metrics", str(m), "--plot", str(p), "--no-progress"])
    check_outputs(rows, m, p, steps_per_config=6)
    out = capsys.readouterr().out
    assert "held-out loss" in out and "flushed" in out
    for r in rows:
        assert 0 < r["held-out loss"] < 6.0 and r["tokens/s"] > 0 and r["state MiB"] > 0
    fp32 = next(r for r in rows if r["config"] == "fp32")
    assert fp32["flushed %"] < 1.0  # tied embedding: only the key bias's gradient is zero in exact arithmetic


def test_stdlib_text_holds_out_the_last_files():
    train, heldout, n_files = textlm.stdlib_text(max_bytes=200_000)
    assert train.dtype == torch.uint8 and len(train) == 200_000 and 0 < len(heldout) <= 20_000
    assert n_files > 50 and b"import" in bytes(train[:100_000].tolist())


def test_parse_configs_is_generic():
    table = {"fp32": None, "fp16 unscaled": None, "fp8": None}
    assert common.parse_configs("fp16-unscaled, fp8", table) == ["fp16 unscaled", "fp8"]
    assert common.parse_configs("FP32,fp16_unscaled", table) == ["fp32", "fp16 unscaled"]
    with pytest.raises(ValueError, match="unknown config 'fp4'"):
        common.parse_configs("fp32,fp4", table)
    with pytest.raises(SystemExit):
        digits.main(["--configs", "nope"])


def test_a_config_setup_rewrites_the_model(monkeypatch):
    seen = []

    def setup(model):
        seen.append(type(model).__name__)
        return model

    monkeypatch.setitem(common.CONFIGS, "fp32+setup", common.ExampleConfig("p=f32,c=f32,o=f32", lambda: __import__(
        "ampfunc").NoOpLossScale(), setup))
    row, history = textlm.train("fp32+setup", steps=2, batch=2, context=8, d=16, layers=1, log_every=2,
                                progress=False, eval_batches=1, data=textlm.stdlib_text(max_bytes=10_000))
    assert seen == ["ByteGPT"] and history["step"] == [0, 1] and row["skipped"] == 0
