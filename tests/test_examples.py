"""The two main jobs, end to end on short settings: what their tables, metrics and plots promise."""

import json

import pytest
import torch

from ampfunc.examples import common, digits, textlm

STEP_KEYS = {"config", "step", "loss", "loss_scale", "finite", "skipped"}
SUMMARY_KEYS = {"config", "summary", "step", "seed", "heldout_loss", "state_bytes_per_param", "flushed_frac",
                "skipped", "loss_scale"}
TINY_TEXT = ["--steps", "6", "--accumulate", "1", "--batch", "4", "--context", "16", "--width", "32", "--layers", "1",
             "--log-every", "2", "--no-progress"]


@pytest.fixture(scope="module")
def text():
    return textlm.stdlib_text(max_bytes=50_000)


def tiny_lm(name, text, **kw):
    settings = {"steps": 6, "batch": 4, "context": 16, "d": 32, "layers": 1, "log_every": 2, "progress": False,
                "eval_batches": 2, "data": text}
    return textlm.train(name, **{**settings, **kw})


def read_metrics(path):
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    steps = [m for m in lines if not m.get("summary")]
    summaries = {m["config"]: m for m in lines if m.get("summary")}
    return lines, steps, summaries


def check_outputs(rows, metrics_path, plot_path, steps_per_config):
    import matplotlib.image

    names = [r["config"] for r in rows]
    assert names == list(common.CONFIGS)
    lines, steps, summaries = read_metrics(metrics_path)
    assert all(STEP_KEYS <= set(m) for m in steps)
    for name in names:
        mine = [m for m in lines if m["config"] == name]
        assert [m["step"] for m in mine[:-1]] == list(range(steps_per_config))  # every step, in order
        assert mine[-1] is summaries[name]  # the config's last record is its summary
        assert SUMMARY_KEYS <= set(mine[-1]) and mine[-1]["step"] == steps_per_config
        row = next(r for r in rows if r["config"] == name)
        assert mine[-1]["skipped"] == mine[-2]["skipped"] == row["skipped"]
    image = matplotlib.image.imread(plot_path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    return summaries


def test_digits_every_config_writes_steps_summaries_and_a_plot(tmp_path, capsys):
    m, p = tmp_path / "m.jsonl", tmp_path / "p.png"
    rows = digits.main(["--epochs", "1", "--batch", "256", "--log-every", "2", "--metrics", str(m), "--plot", str(p),
                        "--no-progress"])
    summaries = check_outputs(rows, m, p, steps_per_config=5)
    out = capsys.readouterr().out
    assert "| fp16 unscaled |" in out and "plot:" in out
    assert all(r["test acc"] > 0.3 for r in rows if r["skipped"] < 3)  # five applied steps already learn
    assert all(s["heldout_loss"] == r["test loss"] for s, r in zip(summaries.values(), rows))


def test_textlm_every_config_writes_steps_summaries_and_a_plot(tmp_path, capsys):
    m, p = tmp_path / "m.jsonl", tmp_path / "p.png"
    rows = textlm.main(TINY_TEXT + ["--metrics", str(m), "--plot", str(p)])
    summaries = check_outputs(rows, m, p, steps_per_config=6)
    out = capsys.readouterr().out
    assert "held-out loss" in out and "flushed" in out
    for r in rows:
        assert 0 < r["held-out loss"] < 6.0 and r["tokens/s"] > 0
        assert summaries[r["config"]]["heldout_loss"] == r["held-out loss"]


def test_state_bytes_per_param_counts_params_master_and_moments(text):
    fp32, _ = tiny_lm("fp32", text, steps=2)
    fp16, _ = tiny_lm("fp16 unscaled", text, steps=2)
    # fp32: the param and two fp32 moments (12 B); fp16: a 2 B param, its fp32 master, two moments
    # (14 B), less for the LayerNorm params that stay fp32 without a master copy
    assert 12.0 <= fp32["state B/param"] < 12.05
    assert 13.9 < fp16["state B/param"] < 14.05


def test_state_bytes_counts_a_shared_storage_once():
    buffer = torch.zeros(100)
    assert common.state_bytes({"a": buffer[:50], "b": buffer[50:]}) == 400
    assert common.state_bytes({"a": torch.zeros(10, dtype=torch.float16)}, [torch.zeros(3)]) == 32


def test_count_flushed_counts_zeros_that_fp32_does_not_have():
    grads = {"w": torch.tensor([0.0, 0.0, 1.0], dtype=torch.float16)}
    reference = {"w": torch.tensor([0.0, 1e-9, 1.0])}
    assert int(common.count_flushed(grads, reference)) == 1


def test_fp16_unscaled_flushes_gradients_that_dynamic_scaling_keeps(text):
    # 2,048 tokens per step: the mean loss puts some gradient elements below fp16's smallest
    # subnormal already at init (the first step is the one compared, log_every=2 of 2 steps)
    settings = {"steps": 2, "batch": 32, "context": 64, "d": 32, "layers": 1}
    unscaled, _ = tiny_lm("fp16 unscaled", text, **settings)
    dynamic, _ = tiny_lm("fp16+dynamic", text, **settings)
    assert unscaled["flushed %"] > 0.0 and dynamic["flushed %"] == 0.0


def test_accumulation_shrinks_gradients_so_unscaled_fp16_flushes_more(text):
    # the first micro-batch is the same batch for every K; its loss divided by K flushes more
    settings = {"steps": 2, "batch": 32, "context": 64, "d": 32, "layers": 1, "log_every": 2, "eval_batches": 1}
    one, _ = tiny_lm("fp16 unscaled", text, **settings)
    eight, _ = tiny_lm("fp16 unscaled", text, accumulate=8, **settings)
    dynamic, _ = tiny_lm("fp16+dynamic", text, accumulate=8, **settings)
    assert eight["flushed %"] > one["flushed %"] > 0.0 and dynamic["flushed %"] == 0.0


def test_accumulate_flag_rejects_zero(capsys):
    with pytest.raises(SystemExit):
        textlm.main(TINY_TEXT + ["--accumulate", "0"])
    assert "--accumulate must be >= 1" in capsys.readouterr().err


def test_dynamic_scale_starts_high_skips_and_backs_off(text):
    row, history = tiny_lm("fp16+dynamic", text, steps=12)
    # the scale recorded after each step: the first steps overflow, each halving the scale from 2^24
    lead = history["finite"].index(True)
    assert lead >= 1 and history["loss_scale"][:lead] == [2.0 ** (23 - i) for i in range(lead)]
    assert history["loss_scale"][lead] == 2.0 ** (24 - lead)  # the first scale that fits is kept
    assert lead <= row["skipped"] < 12


def test_unscaled_rows_never_skip_and_keep_scale_one(text):
    row, history = tiny_lm("fp16 unscaled", text)
    assert row["skipped"] == 0 and set(history["loss_scale"]) == {1.0}


def test_seed_makes_a_run_reproducible(tmp_path, text):
    a, ha = tiny_lm("fp16+dynamic", text, seed=3)
    b, hb = tiny_lm("fp16+dynamic", text, seed=3)
    _, hc = tiny_lm("fp16+dynamic", text, seed=4)
    assert ha["loss"] == hb["loss"] and a["held-out loss"] == b["held-out loss"]
    assert ha["loss"] != hc["loss"]


def test_seed_flag_reaches_the_summary(tmp_path):
    m = tmp_path / "m.jsonl"
    digits.main(["--epochs", "1", "--batch", "512", "--configs", "fp32", "--seed", "7", "--metrics", str(m),
                 "--no-progress"])
    assert read_metrics(m)[2]["fp32"]["seed"] == 7


@pytest.mark.parametrize("job, name", [(digits, "digits"), (textlm, "textlm")])
def test_help_names_the_job(job, name, capsys):
    with pytest.raises(SystemExit):
        job.main(["--help"])
    out = capsys.readouterr().out
    assert f"ampfunc {name}:" in out and "--seed" in out


def test_progress_bar_shows_small_losses_with_significant_digits(capsys):
    log = common.LiveLog("fp32", 2, params={"w": torch.zeros(3)}, log_every=2, progress=True)
    for loss in (0.5, 0.00012345):
        log.monitor = log.monitor.record(finite=torch.tensor(True), loss=torch.tensor(loss))
        log.step()
    log.close()
    err = capsys.readouterr().err
    assert "loss=0.0001234" in err or "loss=0.0001235" in err


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


def test_a_row_is_one_config_entry(monkeypatch, text):
    seen = []

    def setup(model):
        seen.append(type(model).__name__)
        return model

    import ampfunc as af

    config = common.ExampleConfig("p=f32,c=f32,o=f32", af.NoOpLossScale, setup)
    monkeypatch.setitem(common.CONFIGS, "fp32+setup", config)
    row, history = tiny_lm("fp32+setup", text, steps=2)
    assert seen == ["ByteGPT"] and history["step"] == [0, 1] and row["skipped"] == 0


def test_master_setting_reaches_mixed_precision(monkeypatch):
    passed = {}

    def fake_mixed_precision(inner, **kw):
        passed.update(kw)

    monkeypatch.setattr(common.af, "mixed_precision", fake_mixed_precision)
    default = common.ExampleConfig("p=bf16,c=bf16,o=f32", common.af.NoOpLossScale)
    common.make_transform(default, inner=None)
    assert "master" not in passed and "moments" not in passed
    common.make_transform(default._replace(master="split", moments="q8"), inner=None)
    # moments belong to the optimizer (af.adamw(moments=)), not to mixed_precision
    assert passed["master"] == "split" and "moments" not in passed


def test_lowmem_rows_reach_the_optimizer_and_the_step(text):
    split, _ = tiny_lm("bf16-split", text, steps=2)
    low, _ = tiny_lm("bf16-lowmem", text, steps=2)
    assert split["skipped"] == 0 and low["skipped"] == 0
    # split: a 2 B param and its 2 B low half, two fp32 moments (12 B; the fp32 LayerNorm params
    # too: 4 + 8). lowmem: the same, with the moments of the leaves of 4,096+ elements (the
    # embedding) in 8-bit codes plus one fp32 absmax per 256
    assert 11.95 < split["state B/param"] < 12.05
    assert low["state B/param"] < split["state B/param"] - 2.0
