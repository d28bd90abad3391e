"""The recipes of docs/recipes.md (Lightning, timm, HuggingFace) run as written.

Recipe blocks are fenced ```python recipe=<package>: tests/test_docs.py skips them (they need
optional packages); each test here runs one when its package imports (``ampfunc[recipes]``).

timm imports torchvision, and PyPI's torchvision wheels do not load beside every torch build
(``operator torchvision::nms does not exist`` beside torch 2.13.0+cpu). Where timm cannot be
imported, its recipe runs against a stand-in ``timm.utils.NativeScaler`` written from timm's
documented behaviour (``state_dict_key = "amp_scaler"``; ``__init__(device)`` builds
``torch.amp.GradScaler(device=device)`` as ``_scaler``; ``__call__(loss, optimizer, clip_grad,
clip_mode, parameters, create_graph, need_update)`` scales and backpropagates, and when
``need_update`` unscales before clipping ``parameters``, steps and updates; ``state_dict`` /
``load_state_dict`` delegate to ``_scaler``).
"""

import pathlib
import re
import sys
import types

import pytest
import torch

from ampfunc.compat.torch_amp import GradScaler

RECIPES_PAGE = pathlib.Path(__file__).parent.parent / "docs" / "recipes.md"
RECIPES = dict(re.findall(r"^```python recipe=(\w+)\n(.*?)^```", RECIPES_PAGE.read_text(), re.S | re.M))


def _run(name, monkeypatch):
    module = types.ModuleType(f"ampfunc_recipe_{name}")  # torch.compile looks the module up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(RECIPES[name], f"docs/recipes.md recipe {name}", "exec"), module.__dict__)
    return module.__dict__


def test_the_recipes_page_has_the_three_recipes():
    assert set(RECIPES) == {"lightning", "timm", "transformers"}


def test_lightning_recipe(monkeypatch, capsys):
    pytest.importorskip("lightning.pytorch")
    ns = _run("lightning", monkeypatch)
    assert ns["trainer"].precision_plugin.scaler is ns["scaler"] and isinstance(ns["scaler"], GradScaler)
    assert ns["trainer"].global_step == 6
    assert "refused: `precision='bf16-mixed'` does not use a scaler" in capsys.readouterr().out


def test_transformers_recipe(monkeypatch):
    pytest.importorskip("transformers")
    ns = _run("transformers", monkeypatch)
    # The tied leaf changed once, from the sum of both uses' gradients.
    assert not torch.equal(ns["p_c"]["transformer.wte.weight"], ns["params"]["transformer.wte.weight"])


class _NativeScalerStandIn:
    """timm.utils.NativeScaler's documented behaviour (see the module docstring)."""

    state_dict_key = "amp_scaler"

    def __init__(self, device="cuda"):
        self._scaler = torch.amp.GradScaler(device=device)

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None, create_graph=False,
                 need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None and clip_mode == "norm"
                self._scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


def _timm_utils(monkeypatch):
    try:
        import timm.utils

        return timm.utils
    except Exception:  # ImportError, or torchvision's RuntimeError when its ops do not load
        for name in [m for m in sys.modules if m == "timm" or m.startswith(("timm.", "torchvision"))]:
            monkeypatch.delitem(sys.modules, name)
        timm, utils = types.ModuleType("timm"), types.ModuleType("timm.utils")
        utils.NativeScaler = _NativeScalerStandIn
        timm.utils = utils
        monkeypatch.setitem(sys.modules, "timm", timm)
        monkeypatch.setitem(sys.modules, "timm.utils", utils)
        return utils


def test_timm_recipe(monkeypatch):
    _timm_utils(monkeypatch)
    ns = _run("timm", monkeypatch)
    scaler = ns["loss_scaler"]._scaler
    assert isinstance(scaler, GradScaler) and len(scaler._per_optimizer_states) == 0  # update() ran
    steps = [ns["optimizer"].state[p]["step"].item() for p in ns["model"].parameters()]
    assert steps == [3.0] * 4
