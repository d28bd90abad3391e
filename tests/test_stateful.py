"""ModuleTrainer's state: what ``trainer.state = ...`` and ``load_state_dict`` accept.

README, "Names that changed": ``TrainerState`` gained two trailing fields (``finite``,
``skipped``) with ``None`` defaults, so a state built with the old three fields keeps working;
the trainer fills them in as a fresh trainer's are. Assigning is all-or-nothing.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import ampfunc as af


def _trainer(flat=False, seed=0, width=3):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, 4), nn.Linear(4, 2))
    return model, af.ModuleTrainer(model, af.adamw(1e-2), loss_scale=af.DynamicLossScale(2.0**8), flat=flat)


def _step(model, trainer, overflow=False):
    trainer.scale(model(torch.randn(5, model[0].in_features)).square().mean()).backward()
    if overflow:
        model[1].bias.grad[0] = float("inf")
    return trainer.step()


@pytest.mark.parametrize("flat", [False, True], ids=["per-param", "flat"])
@pytest.mark.parametrize("load", ["assign", "load_state_dict"])
def test_a_state_built_with_the_three_old_fields_loads_and_the_next_step_counts_from_fresh(flat, load):
    model, trainer = _trainer(flat)
    _step(model, trainer)
    _step(model, trainer, overflow=True)  # one skipped step: finite False, skipped 1
    st = trainer.state
    old = af.stateful.TrainerState(st.master, st.opt_state, st.loss_scale)  # finite, skipped: None
    buf = io.BytesIO()
    torch.save({"trainer": old}, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only: TrainerState is an allowed global
    if load == "assign":
        trainer.state = loaded["trainer"]
    else:
        trainer.load_state_dict(loaded)
    assert trainer.state.finite.dtype == torch.bool and bool(trainer.state.finite)
    assert trainer.state.skipped.dtype == torch.int64 and int(trainer.state.skipped) == 0
    assert float(trainer.loss_scale.loss_scale) == 2.0**7  # the loaded scale, halved by the overflow
    _step(model, trainer, overflow=True)
    assert not bool(trainer.finite) and int(trainer.skipped) == 1
    _step(model, trainer)
    assert bool(trainer.finite) and int(trainer.skipped) == 1


def test_a_four_field_state_keeps_its_finite_flag_and_gets_a_fresh_skip_count():
    model, trainer = _trainer()
    _step(model, trainer, overflow=True)
    st = trainer.state
    trainer.state = af.stateful.TrainerState(st.master, st.opt_state, st.loss_scale, st.finite.clone())
    assert not bool(trainer.state.finite) and int(trainer.state.skipped) == 0


def test_an_old_field_state_of_another_model_is_refused_and_the_trainer_keeps_its_own():
    model, trainer = _trainer()
    _step(model, trainer)
    before = trainer.state
    _, other = _trainer(width=5)  # another first-layer shape
    ost = other.state
    with pytest.raises(ValueError, match=r"leaf '.*0\.weight.*' is torch.float32 \(4, 5\)"):
        trainer.state = af.stateful.TrainerState(ost.master, ost.opt_state, ost.loss_scale)
    assert trainer.state is before
    _step(model, trainer)
    assert bool(trainer.finite) and int(trainer.skipped) == 0
