"""The six places where the apex facades differed from apex's own code.

apex cannot be installed here. Each test states the behaviour of apex's last ``fp16_utils`` /
``amp`` Python sources as a fact and checks the facade against it; where apex stores objects in
checkpoints, a stand-in class with exactly the attributes apex's ``amp.scaler.LossScaler``
pickles plays apex's part, registered under apex's module name so that pickling goes through
the same path a real apex checkpoint does.
"""

import io
import pickle
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampfunc.compat.apex import amp, checkpoint
from ampfunc.compat.apex.amp import _amp_state
from ampfunc.compat.apex.fp16_utils import DynamicLossScaler, FP16_Optimizer

# apex amp keeps process-wide state: every test here starts from a fresh one.
pytestmark = pytest.mark.usefixtures("fresh_amp_state")


class ApexAmpLossScaler:
    """Stand-in for ``apex.amp.scaler.LossScaler``: the attributes apex sets in ``__init__`` (and
    so pickles), and the update rule of its ``update_scale`` (fused-kernel path), as facts."""

    def __init__(self, loss_scale, init_scale=2.0**16, scale_factor=2.0, scale_window=2000,
                 min_loss_scale=None, max_loss_scale=2.0**24):
        self.dynamic = loss_scale == "dynamic"
        self._loss_scale = min(max_loss_scale, init_scale) if self.dynamic else loss_scale
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = scale_window
        self._unskipped = 0
        self._has_overflow = False
        self._overflow_buf = torch.zeros(1, dtype=torch.int32)

    def loss_scale(self):
        return self._loss_scale

    def update_scale(self):
        if self.dynamic and not self._has_overflow:
            self._has_overflow = bool(self._overflow_buf.item())
        if self._has_overflow and self.dynamic:
            skip = True
            self._loss_scale = (max(self._min_loss_scale, self._loss_scale / 2.0) if self._min_loss_scale
                                else self._loss_scale / 2.0)
            self._unskipped = 0
        else:
            skip = False
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * 2.0)
            self._unskipped = 0
        return skip


APEX_ATTRS = {"dynamic", "_loss_scale", "_max_loss_scale", "_min_loss_scale", "_scale_seq_len", "_unskipped",
              "_has_overflow", "_overflow_buf"}


@pytest.fixture
def fake_apex(monkeypatch):
    """Registers the stand-in as ``apex.amp.scaler.LossScaler`` so pickles name apex's class."""
    mods = {name: types.ModuleType(name) for name in ("apex", "apex.amp", "apex.amp.scaler")}
    cls = type("LossScaler", (ApexAmpLossScaler,), {"__module__": "apex.amp.scaler", "__qualname__": "LossScaler"})
    mods["apex.amp.scaler"].LossScaler = cls
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return cls


class Half(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4).half()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return self.fc(x.half()).float() * self.gain


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


# ---------------------------------------------------------------------------------------------
# 1. FP16_Optimizer's dynamic scale is apex amp's LossScaler("dynamic", **dynamic_loss_args)
# ---------------------------------------------------------------------------------------------


def test_fresh_dynamic_fp16_optimizer_starts_at_65536_with_or_without_args():
    for args in (None, {}, {"scale_window": 10}):
        opt = FP16_Optimizer(torch.optim.SGD(Half().parameters(), lr=0.1), dynamic_loss_scale=True,
                             dynamic_loss_args=args, verbose=False)
        assert opt.loss_scale == 65536.0
    assert DynamicLossScaler().loss_scale == 2.0**32  # the fp16_utils class itself is unchanged
    with pytest.raises(TypeError, match="unknown keys \\['scale_windw'\\]"):
        FP16_Optimizer(torch.optim.SGD(Half().parameters(), lr=0.1), dynamic_loss_scale=True,
                       dynamic_loss_args={"scale_windw": 3}, verbose=False)


def _run_rule(scaler_args, overflows, set_scale=None):
    opt = FP16_Optimizer(torch.optim.SGD(Half().parameters(), lr=0.0), dynamic_loss_scale=True,
                         dynamic_loss_args=scaler_args, verbose=False)
    ref = ApexAmpLossScaler("dynamic", **scaler_args)
    if set_scale is not None:
        opt.loss_scale = ref._loss_scale = set_scale
    got, want = [], []
    for overflow in overflows:
        scaler = opt.loss_scaler
        scaler.clear_overflow_state()
        finite = torch.tensor(not overflow)
        opt.overflow = scaler.update_scale(finite)
        ref._has_overflow = overflow
        want_skip = ref.update_scale()
        assert opt.overflow == want_skip
        got.append((opt.loss_scale, scaler._unskipped))
        want.append((ref._loss_scale, ref._unskipped))
    return got, want


@pytest.mark.parametrize("args, set_scale", [
    ({}, None),                                                       # 2**16, window 2000, cap 2**24
    ({"init_scale": 2.0**30}, None),                                  # capped at max_loss_scale
    ({"scale_window": 3, "max_loss_scale": 2.0**18}, None),           # growth stops at the cap
    ({"scale_window": 3}, 1.0),                                       # no floor of 1: 0.5, 0.25, ...
    ({"scale_window": 3, "min_loss_scale": 0.25}, 1.0),               # min_loss_scale is the floor
    ({"scale_window": 3, "min_loss_scale": 2.0**20}, None),           # a floor above the start: the first
    ({"scale_window": 3, "min_loss_scale": 8.0}, 1.0),                # overflow raises the scale to it
    ({"scale_window": 2, "scale_factor": 3.0}, None),                 # scale_factor ignored, as in apex
])
def test_dynamic_rule_step_for_step_with_apex_amp_scaler(args, set_scale):
    overflows = [False] * 5 + [True] * 4 + [False] * 7 + [True] + [False] * 3
    got, want = _run_rule(args, overflows, set_scale)
    assert got == want



def test_min_loss_scale_above_the_start_is_accepted_as_apex_does():
    # apex amp's LossScaler starts at min(max_loss_scale, init_scale) whatever min_loss_scale is;
    # min_loss_scale only floors the halving, so the first overflow raises the scale to it.
    model = Half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         dynamic_loss_args={"min_loss_scale": 2.0**20}, verbose=False)
    assert opt.loss_scale == 65536.0
    x, y = _batch()
    opt.zero_grad()
    opt.backward(F.mse_loss(model(x), y) * float("inf"))
    assert opt.overflow and opt.loss_scale == 2.0**20
    # amp.initialize has no init_scale: a floor above 2**16 works the same way.
    model = nn.Linear(8, 4)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", min_loss_scale=2.0**17,
                   verbosity=0)
    assert _amp_state.loss_scalers[0].loss_scale() == 65536.0 and _amp_state.loss_scalers[0]._min_loss_scale == 2.0**17



@pytest.mark.parametrize("args, match", [
    ({"min_loss_scale": 1e39, "max_loss_scale": float("inf")}, "min_loss_scale must be at most fp32's largest"),
    ({"max_loss_scale": 0}, "max_loss_scale must be > 0"),
])
def test_scaler_bounds_no_scale_can_meet_are_refused_naming_apex_setting(args, match):
    with pytest.raises(ValueError, match=match):
        FP16_Optimizer(torch.optim.SGD(Half().parameters(), lr=0.1), dynamic_loss_scale=True,
                       dynamic_loss_args=args, verbose=False)

def test_apex_checkpoint_with_a_scale_below_its_floor_loads_and_keeps_apex_rule(fake_apex):
    # What apex's scaler holds after starting below min_loss_scale loads as it is.
    model = Half()
    apex_scaler = fake_apex("dynamic", min_loss_scale=2.0**20, scale_window=2)
    assert apex_scaler._loss_scale == 65536.0
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dynamic_loss_scale=True,
                         verbose=False)
    opt.load_state_dict(_apex_checkpoint(model, apex_scaler))
    assert opt.loss_scale == 65536.0 and opt.loss_scaler._min_loss_scale == 2.0**20
    for overflow in (False, False, True):
        opt.loss_scaler.update_scale(torch.tensor(not overflow))
        apex_scaler._has_overflow = overflow
        apex_scaler.update_scale()
        assert opt.loss_scale == apex_scaler._loss_scale  # 2**17 after the window, then the floor 2**20
    assert opt.loss_scale == 2.0**20

def test_default_window_is_2000_clean_steps():
    opt = FP16_Optimizer(torch.optim.SGD(Half().parameters(), lr=0.0), dynamic_loss_scale=True, verbose=False)
    opt.loss_scaler._unskipped = 1998
    for expected in (65536.0, 131072.0):
        opt.loss_scaler.update_scale(torch.tensor(True))
        assert opt.loss_scale == expected
    assert opt.loss_scaler._unskipped == 0


# ---------------------------------------------------------------------------------------------
# 2. FP16_Optimizer checkpoints cross-load with apex's, both ways
# ---------------------------------------------------------------------------------------------


def _apex_checkpoint(model, scaler):
    """An FP16_Optimizer.state_dict() as apex writes it: its keys, the scaler object itself."""
    master = model.fc.weight.detach().float().clone() + 0.25
    master_b = model.fc.bias.detach().float().clone()
    inner = torch.optim.SGD([master, master_b, model.gain], lr=0.1, momentum=0.9)
    return {"loss_scaler": scaler, "dynamic_loss_scale": scaler.dynamic, "overflow": False,
            "first_closure_call_this_step": True, "optimizer_state_dict": inner.state_dict(),
            "fp32_from_fp16": [[master, master_b]]}


def test_apex_checkpoint_object_loads_and_trains(fake_apex):
    model = Half()
    apex_scaler = fake_apex("dynamic", scale_window=4)
    apex_scaler._loss_scale, apex_scaler._unskipped = 1024.0, 3
    ckpt = _apex_checkpoint(model, apex_scaler)
    buf = io.BytesIO()
    torch.save({"optimizer": ckpt}, buf)
    del sys.modules["apex.amp.scaler"], sys.modules["apex.amp"], sys.modules["apex"]  # a machine without apex
    buf.seek(0)
    with pytest.raises(ModuleNotFoundError, match="apex"):
        torch.load(buf, weights_only=False)
    buf.seek(0)
    loaded = checkpoint.load(buf, map_location="cpu")["optimizer"]
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dynamic_loss_scale=True,
                         verbose=False)
    opt.load_state_dict(loaded)
    assert opt.loss_scale == 1024.0 and opt.loss_scaler._unskipped == 3 and opt.loss_scaler._scale_seq_len == 4
    assert torch.equal(opt.fp32_from_fp16_groups[0][0], ckpt["fp32_from_fp16"][0][0])
    x, y = _batch()
    opt.zero_grad()
    opt.backward(F.mse_loss(model(x), y))  # apex's object used to fail here ("no attribute 'backward'")
    assert not opt.overflow and opt.loss_scale == 2048.0  # the 4th clean step in a row doubles
    opt.step()
    assert torch.equal(model.fc.weight, opt.fp32_from_fp16_groups[0][0].half())


def test_apex_scaler_object_in_memory_and_older_fp16_utils_scalers_load():
    model = Half()
    s = ApexAmpLossScaler(128.0)
    s._unskipped = 7
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), verbose=False)
    opt.load_state_dict(_apex_checkpoint(model, s))
    assert opt.loss_scale == 128.0 and not opt.loss_scaler.dynamic and opt.loss_scaler._unskipped == 7
    # Checkpoints of older apex (and of this facade before) hold an fp16_utils DynamicLossScaler.
    old = DynamicLossScaler(init_scale=2.0**10, scale_window=5)
    old.cur_iter, old.last_overflow_iter = 7, 4
    opt.load_state_dict({**_apex_checkpoint(model, s), "loss_scaler": old, "dynamic_loss_scale": True})
    assert opt.loss_scale == 1024.0 and opt.loss_scaler.dynamic and opt.loss_scaler._unskipped == 2
    with pytest.raises(TypeError, match="not an apex loss scaler"):
        opt.load_state_dict({**_apex_checkpoint(model, s), "loss_scaler": 3.0})
    assert opt.loss_scale == 1024.0  # a refused load changes nothing


class _AsApex(pickle.Unpickler):
    """Reads the facade's pickled scaler as apex's class (what apex's environment would build)."""

    def find_class(self, module, name):
        if (module, name) == ("ampfunc.compat.apex._scaler", "LossScaler"):
            return ApexAmpLossScaler
        return super().find_class(module, name)


def test_facade_checkpoint_holds_what_apex_reads_and_runs_apex_rule():
    model = Half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dynamic_loss_scale=True,
                         dynamic_loss_args={"scale_window": 3}, verbose=False)
    x, y = _batch()
    for _ in range(2):
        opt.zero_grad()
        opt.backward(F.mse_loss(model(x), y))
        opt.step()
    sd = opt.state_dict()
    assert set(sd) == {"loss_scaler", "dynamic_loss_scale", "overflow", "first_closure_call_this_step",
                       "optimizer_state_dict", "fp32_from_fp16"}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert torch.load(buf)["loss_scaler"].loss_scale() == 65536.0  # weights_only loading accepts it
    # apex's FP16_Optimizer.load_state_dict stores the object and then calls loss_scale(),
    # clear_overflow_state(), unscale(model_grads, master_grads, scale) and update_scale() on it.
    buf.seek(0)
    ours = torch.load(buf, weights_only=False)["loss_scaler"]
    assert callable(ours.loss_scale) and ours.loss_scale() == 65536.0 and ours._unskipped == 2
    g16 = torch.tensor([2.0, 4.0], dtype=torch.float16)
    g32 = torch.empty(2)
    ours.clear_overflow_state()
    ours.unscale([g16], [g32], ours.loss_scale())
    assert g32.tolist() == [2.0 / 65536, 4.0 / 65536]
    assert ours.update_scale() is False and ours.loss_scale() == 131072.0  # 3rd clean step in a row
    ours.clear_overflow_state()
    ours.unscale([torch.tensor([float("inf")], dtype=torch.float16)], [torch.empty(1)], ours.loss_scale())
    assert ours.update_scale() is True and ours.loss_scale() == 65536.0
    # And the pickled attributes are exactly apex's: read as apex's class, apex's rule runs on them.
    buf.seek(0)
    payload = torch.load(buf, weights_only=False)  # re-pickle the scaler alone through plain pickle
    as_apex = _AsApex(io.BytesIO(pickle.dumps(payload["loss_scaler"]))).load()
    assert isinstance(as_apex, ApexAmpLossScaler) and set(vars(as_apex)) == APEX_ATTRS
    assert (as_apex._loss_scale, as_apex._unskipped, as_apex._scale_seq_len) == (65536.0, 2, 3)
    assert as_apex.update_scale() is False and as_apex._loss_scale == 131072.0


@pytest.mark.parametrize("protocol", [2, 4])
def test_save_for_apex_writes_apex_class_which_a_machine_without_ampfunc_reads(fake_apex, protocol):
    model = Half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         dynamic_loss_args={"scale_window": 3}, verbose=False)
    opt.loss_scaler._unskipped = 2
    buf = io.BytesIO()
    checkpoint.save_for_apex({"optimizer": opt.state_dict()}, buf, pickle_protocol=protocol)
    assert b"ampfunc" not in buf.getvalue()  # nothing in the file names ampfunc
    buf.seek(0)
    scaler = torch.load(buf, weights_only=False)["optimizer"]["loss_scaler"]
    assert type(scaler) is fake_apex and set(vars(scaler)) == APEX_ATTRS
    assert scaler.update_scale() is False and scaler._loss_scale == 131072.0  # apex's rule, 3rd clean step
    del sys.modules["apex.amp.scaler"], sys.modules["apex.amp"], sys.modules["apex"]
    buf.seek(0)
    opt.load_state_dict(checkpoint.load(buf)["optimizer"])
    assert opt.loss_scale == 65536.0 and opt.loss_scaler._unskipped == 2


def test_static_scale_counts_unskipped_in_fp16_optimizer():
    model = Half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=64.0, verbose=False)
    x, y = _batch()
    for _ in range(3):
        opt.zero_grad()
        opt.backward(F.mse_loss(model(x), y))
        opt.step()
    assert opt.loss_scale == 64.0 and opt.loss_scaler._unskipped == 3 and not opt.overflow


# ---------------------------------------------------------------------------------------------
# 3-5. O2: restore, fp32 state_dict, optimizer state loaded through fp16
# ---------------------------------------------------------------------------------------------


def test_o2_restore_trains_from_the_loaded_weights():
    model = nn.Linear(4, 4)
    m, o = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), opt_level="O2", verbosity=0)
    m.load_state_dict({k: torch.ones_like(v) for k, v in m.state_dict().items()})
    o.zero_grad()
    masters = list(amp.master_params(o))
    assert all(p.dtype == torch.float32 and torch.equal(p, torch.ones_like(p)) for p in masters)
    x = torch.full((2, 4), 0.5)
    with amp.scale_loss(m(x).mean(), o) as scaled:
        scaled.backward()
    o.step()
    # d(mean(W x + b))/dW = 2 * 0.5 / 8 per entry, d/db = 2 / 8: one step of lr 0.5 from ones.
    assert torch.equal(m.weight, torch.full((4, 4), 0.9375, dtype=torch.float16))
    assert torch.equal(m.bias, torch.full((4,), 0.875, dtype=torch.float16))


def _o2_run(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()


def test_o2_checkpoint_restore_like_apex_test_restoring():
    batches = [_batch(i) for i in range(6)]
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                opt_level="O2", verbosity=0)
    _o2_run(model, opt, batches[:3])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    assert all(v.dtype == torch.float32 for k, v in ckpt["model"].items() if v.is_floating_point())
    _o2_run(model, opt, batches[3:])

    torch.manual_seed(2)  # different initial weights: the checkpoint must override them
    fresh = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    fresh, fresh_opt = amp.initialize(fresh, torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9),
                                      opt_level="O2", verbosity=0)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    _o2_run(fresh, fresh_opt, batches[3:])
    # The restored masters start from the fp16 weights (fp32 masters are not in apex's
    # checkpoint) and momentum rounded through fp16, so the runs agree to fp16 precision.
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert a.dtype == b.dtype, n
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 6}}


def test_o2_state_dict_is_fp32_and_loads_back_and_into_an_fp32_model():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    assert model[0].weight.dtype == torch.float16
    sd = model.state_dict()
    assert {k: v.dtype for k, v in sd.items()} == {
        "0.weight": torch.float32, "0.bias": torch.float32, "1.weight": torch.float32, "1.bias": torch.float32,
        "1.running_mean": torch.float32, "1.running_var": torch.float32, "1.num_batches_tracked": torch.int64}
    assert torch.equal(sd["0.weight"], model[0].weight.float())
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    plain.load_state_dict(sd)
    model.load_state_dict(plain.state_dict())
    assert model[0].weight.dtype == torch.float16
    o3, _ = amp.initialize(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
                           opt_level="O3", verbosity=0)
    assert o3.state_dict()["weight"].dtype == torch.float32  # apex hooks every cast model (O2 and O3)
    o1, _ = amp.initialize(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
                           opt_level="O1", verbosity=0)
    assert o1.weight.dtype == torch.float32 and o1.state_dict()["weight"].dtype == torch.float32


def test_o2_optimizer_state_loaded_after_initialize_is_rounded_through_fp16_as_apex():
    model = nn.Linear(2, 2)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                opt_level="O2", verbosity=0)
    saved = {"state": {i: {"momentum_buffer": torch.full(p.shape, 0.1)} for i, p in enumerate(model.parameters())},
             "param_groups": opt.state_dict()["param_groups"]}
    opt.load_state_dict(saved)
    opt.zero_grad()  # apex makes the masters here and recasts the state to fp32
    for master in amp.master_params(opt):
        buf = opt.state[master]["momentum_buffer"]
        assert buf.dtype == torch.float32 and torch.all(buf == 0.0999755859375)
    # Once the masters exist, state loads at fp32 without rounding (apex behaves the same).
    opt.load_state_dict(saved)
    assert all(torch.all(opt.state[m]["momentum_buffer"] == torch.tensor(0.1)) for m in amp.master_params(opt))


# ---------------------------------------------------------------------------------------------
# 6. a static loss scale counts unskipped steps; amp.init() is refused with what to use
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opt_level, loss_scale, expected", [("O2", 128.0, 4), ("O1", 8.0, 4), ("O3", 16.0, 4),
                                                             ("O0", None, 0), ("O3", None, 0)])
def test_static_scale_unskipped_counts_steps_in_amp_state_dict(opt_level, loss_scale, expected):
    model = nn.Linear(8, 4)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01), opt_level=opt_level,
                                loss_scale=loss_scale, verbosity=0)
    _o2_run(model, opt, [_batch(i) for i in range(4)])
    # Scale 1 without master weights skips apex's bookkeeping altogether (O0/O3 defaults).
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": loss_scale or 1.0, "unskipped": expected}
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 11}})
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 4.0, "unskipped": 11}


def test_amp_init_is_refused_naming_initialize():
    with pytest.raises(RuntimeError, match=r"amp\.init\(\).*amp\.initialize\(model, optimizer, opt_level='O1'\)"):
        amp.init(enabled=True)
