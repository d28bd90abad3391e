"""The low-memory settings (``master="split"``, ``moments="bf16"|"q8"``) composed with DDP, FSDP2,
FP8 layers and torch.func.

Distributed (two gloo ranks on CPU, bf16 params, ``_dist_lowmem_worker.py``): on every path
(``mixed_precision`` ``step``/``step_``, ``make_train_step`` ``step``/``step_``, ``ModuleTrainer``)
the ranks agree on every skip and write nothing at a skipped step (codes included); DDP ranks hold
the same params and state bit for bit; and the run equals one process stepping the whole tensors
with the same settings on the gradients the ranks reduced, bit for bit (the q8 blocks of a shard
that starts on a block boundary are the whole tensor's). Under FSDP2 the state is per shard, the
q8 rule reads the local shard, a moment overflow in one rank's shard is named on every rank, and a
checkpoint of the sharded low-memory state resumes bit for bit.

Why "the gradients the ranks reduced" and not a fresh run on the concatenated batch: with bf16
params the gradients are bf16, and a gradient computed over 4 + 4 rows and averaged in bf16 is not
bit for bit the one computed over 8 rows; Adam turns a one-ulp difference in a gradient near 0
into a difference of up to ``2 * lr`` in a master, in every setting (fp32 moments included). The
step, which is what these settings change, is compared on equal inputs.
"""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad

import ampfunc as af
from ampfunc import fp8 as f8
from ampfunc.lowmem import Q8Moment, SplitMaster

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _dist_lowmem_worker import INJECT_STEP, PATHS, STEPS, loss_scale, net, opt  # noqa: E402
from _helpers import clone_tree, same_tree_bits  # noqa: E402

slow = pytest.mark.slow  # spawns two processes
dist_only = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
EXPECTED_FINITE = [step != INJECT_STEP for step in range(STEPS)]
IDS = ["-".join(p) for p in PATHS]


def launch(scenario, outdir):
    from test_distributed import launch as launch_ranks

    return launch_ranks(scenario, outdir, worker="_dist_lowmem_worker.py")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return launch("paths", tmp_path_factory.mktemp("lowmem_paths"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return launch("sharded_state", tmp_path_factory.mktemp("lowmem_sharded"))


def _cell(paths, key):
    for out in paths:
        assert key not in out["errors"], out["errors"][key]
    return [out["table"][key] for out in paths]


def _one_process(setting, moments, ranks):
    """One process, the whole bf16 tensors, the same settings, fed the gradients the ranks
    reduced: DDP's (equal on both ranks, but for rank 1's inf), FSDP2's shards concatenated."""
    a, b = ranks
    params = {k: v.detach().clone() for k, v in net().named_parameters()}
    tx = af.mixed_precision(opt(moments), loss_scale(), master="split")
    state = tx.init(params)
    masters = []
    for step in range(STEPS):
        if setting == "ddp":
            grads = dict(b["grads"][step]) if step == INJECT_STEP else dict(a["grads"][step])
        else:
            grads = {k: torch.cat([a["grads"][step][k], b["grads"][step][k]]) for k in a["grads"][step]}
        params, state = tx.step_(params, grads, state)
        masters.append(af.master_params(params, state))
    return masters


@slow
@dist_only
@pytest.mark.parametrize("setting,path,moments", PATHS, ids=IDS)
def test_every_low_memory_path_equals_one_process_on_the_reduced_gradients(paths, setting, path, moments):
    ranks = _cell(paths, (setting, path, moments))
    want = _one_process(setting, moments, ranks)
    for rec in ranks:
        for step in range(STEPS):
            for k, m in want[step].items():
                got = rec["masters"][step][k]
                assert (got - m).abs().max() <= 1e-5, (step, k)  # the brief's tolerance...
                assert torch.equal(got, m), (step, k)            # ...and in fact bit for bit


@slow
@dist_only
@pytest.mark.parametrize("setting,path,moments", PATHS, ids=IDS)
def test_an_inf_on_one_rank_skips_the_low_memory_step_on_every_rank_writing_nothing(paths, setting, path, moments):
    a, b = _cell(paths, (setting, path, moments))
    assert a["finite"] == b["finite"] == EXPECTED_FINITE
    assert a["scale"] == b["scale"] and a["scale"][INJECT_STEP] < a["scale"][INJECT_STEP - 1]
    assert not torch.isfinite(b["grads"][INJECT_STEP]["0.weight"]).all()
    if not path.startswith("make_train_step"):  # there rank 1's inf loss reaches every rank's average
        assert torch.isfinite(a["grads"][INJECT_STEP]["0.weight"]).all()  # rank 1's gradient alone
    for rec in (a, b):  # params, low halves, codes, absmaxes, steps: every bit kept
        before, after = rec["state"][INJECT_STEP - 1], rec["state"][INJECT_STEP]
        assert len(before) == len(after) and all(torch.equal(x, y) for x, y in zip(before, after))
        for k, p in rec["params"][INJECT_STEP].items():
            assert torch.equal(p, rec["params"][INJECT_STEP - 1][k]), k


@slow
@dist_only
@pytest.mark.parametrize("path", [p for s, p, _ in PATHS if s == "ddp"])
def test_ddp_ranks_hold_the_same_low_memory_params_and_state_bit_for_bit(paths, path):
    a, b = _cell(paths, ("ddp", path, "q8"))
    for step in range(STEPS):
        assert all(torch.equal(a["params"][step][k], b["params"][step][k]) for k in a["params"][step])
        assert all(torch.equal(x, y) for x, y in zip(a["state"][step], b["state"][step]))
        assert all(torch.equal(a["masters"][step][k], b["masters"][step][k]) for k in a["masters"][step])


@slow
@dist_only
def test_fsdp2_low_memory_state_is_per_shard_and_the_q8_rule_reads_the_local_shard(sharded):
    for out in sharded:
        rows = 17 if out["rank"] == 0 else 16  # 'uneven': 33 rows over two ranks
        # (codes dtype, codes shape, absmax shape, split remainder shape), all of the local shard
        assert out["layout"]["whole"] == ("torch.uint8", (16, 256), (16,), (16, 256))
        assert out["layout"]["uneven"] == ("torch.uint8", (rows, 256), (rows,), (rows, 256))
        # q8 in one process (4,096 elements), fp32 moments on each 2,048-element shard
        assert out["layout"]["halves"] == ("torch.float32", (8, 256), (0,), (8, 256))
        assert out["one_process_q8"] == ["halves", "uneven", "whole"]


@slow
@dist_only
def test_a_q8_moment_overflow_in_one_ranks_shard_is_named_on_every_rank(sharded):
    assert [out["overflow_local"] for out in sharded] == [[], ["whole"]]  # what group= is for
    for out in sharded:
        assert out["overflow_group"] == ["whole"], out["rank"]


@slow
@dist_only
def test_a_checkpoint_of_the_sharded_low_memory_state_resumes_bit_for_bit(sharded):
    for out in sharded:
        assert out["ckpt_q8"] and out["ckpt_state_types"] == ["Tensor"]  # plain local tensors
        assert out["ckpt_skipped"] == (1, 1)  # the inf on rank 1 after the resume, in both runs
        assert all(torch.equal(a, b) for a, b in zip(out["ckpt_params"], out["ckpt_params_resumed"]))
        assert len(out["ckpt_state"]) == len(out["ckpt_state_resumed"])
        assert all(torch.equal(a, b) for a, b in zip(out["ckpt_state"], out["ckpt_state_resumed"]))


# ----------------------------------------------------------------------------------------------
# FP8 layers
# ----------------------------------------------------------------------------------------------


def _fp8_mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 10))
    with torch.no_grad():  # bf16 values, so the bf16-param run and the fp32 one start equal
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def _fp8_run(policy, master, moments, steps=10, inf_at=4):
    model = _fp8_mlp()
    train = af.make_train_step(model, lambda fwd, x, y, w: F.cross_entropy(fwd(x), y) * w,
                               af.adamw(1e-3, moments=moments), policy, master=master,
                               loss_scale=af.DynamicLossScale(2.0 ** 8, growth_interval=3),
                               fp8=f8.fp8_policy(model, exclude=("4",), backend="emulate"))
    state = train.init()
    g = torch.Generator().manual_seed(1)
    flags, masters, kept = [], [], None
    for i in range(steps):
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        before = clone_tree((state.params, state.master, state.opt_state))
        state, out = train.step_(state, x, y, torch.tensor(float("inf") if i == inf_at else 1.0))
        flags.append(bool(out.finite))
        if i == inf_at:
            kept = same_tree_bits(before, (state.params, state.master, state.opt_state))
        masters.append(clone_tree(af.master_params(state.params, state) if master == "split" else state.params))
    return state, flags, masters, kept


def test_fp8_layers_with_split_masters_and_q8_moments_track_the_fp32_run():
    # fp8 "emulate" Linear layers (all but the head), bf16 params with split masters and q8
    # moments, against fp32 params (their own masters) with fp32 moments, from the same values;
    # an inf loss at step 4 is skipped by both, writing no param, low half, code or absmax (the
    # FP8 scaling state alone advances on a skipped step, by design: docs/guides/fp8.md).
    low, low_flags, low_masters, kept = _fp8_run("p=bf16,c=bf16,o=f32", "split", "q8")
    ref, ref_flags, ref_masters, _ = _fp8_run("p=f32,c=bf16,o=f32", "fp32", "fp32")
    assert isinstance(low.master, SplitMaster) and isinstance(low.opt_state.exp_avg, Q8Moment)
    assert low.opt_state.exp_avg.codes["0.weight"].dtype == torch.uint8  # 8,192 elements: q8
    assert low_flags == ref_flags == [i != 4 for i in range(10)] and kept
    start = {k: v.detach() for k, v in _fp8_mlp().named_parameters()}
    for step, (m_low, m_ref) in enumerate(zip(low_masters, ref_masters)):
        moved = sum(float((m_ref[k] - start[k]).abs().mean()) for k in start)
        apart = sum(float((m_low[k] - m_ref[k]).abs().mean()) for k in start)
        # The q8 moments are approximations (test_q8_moments_track_fp32_moments: under 5% of
        # the movement for torch.optim.AdamW); the FP8 forwards read the same bf16 values (a split
        # param is its master rounded, ties away from zero), so the runs part by the moments alone.
        assert apart <= 0.05 * moved, (step, apart, moved)


# ----------------------------------------------------------------------------------------------
# torch.func
# ----------------------------------------------------------------------------------------------


def _func_setup():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    torch.manual_seed(0)
    model = model.to(torch.bfloat16)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(16, 64, generator=g).bfloat16(), torch.randint(0, 10, (16,), generator=g)) for _ in range(4)]
    return model, params, data


def test_functional_call_and_func_grad_feed_the_split_q8_step_as_autograd_does():
    # grads from torch.func.grad over functional_call, into mixed_precision(..., master="split")
    # with q8 moments: the same bits as the module's own backward feeding the same step; an inf
    # loss is skipped.
    model, params, data = _func_setup()
    tx = af.mixed_precision(af.adamw(1e-3, moments="q8"), af.DynamicLossScale(2.0 ** 8), master="split")

    def loss_fn(p, x, y, w, ls):
        return af.scale_loss(F.cross_entropy(functional_call(model, p, (x,)).float(), y) * w, ls)

    p_func, s_func = clone_tree(params), tx.init(clone_tree(params))
    p_mod, s_mod = clone_tree(params), tx.init(clone_tree(params))
    ref_model = _func_setup()[0]
    for i, (x, y) in enumerate(data):
        w = torch.tensor(float("inf") if i == 2 else 1.0)
        grads = grad(loss_fn)(p_func, x, y, w, af.loss_scale_of(s_func))
        p_func, s_func = tx.step(p_func, grads, s_func)
        with torch.no_grad():
            for k, p in ref_model.named_parameters():
                p.copy_(p_mod[k])
        ref_model.zero_grad(set_to_none=True)
        loss_fn(dict(ref_model.named_parameters()), x, y, w, af.loss_scale_of(s_mod)).backward()
        p_mod, s_mod = tx.step_(p_mod, {k: p.grad.clone() for k, p in ref_model.named_parameters()}, s_mod)
        assert same_tree_bits((p_func, s_func), (p_mod, s_mod)), i
    assert int(s_func.skipped) == 1 and isinstance(s_func.inner.exp_avg, Q8Moment)
    assert s_func.inner.exp_avg.codes["0.weight"].dtype == torch.uint8


@pytest.mark.parametrize("how", ["step", "step_", "make_train_step"])
def test_vmap_over_a_low_memory_step_is_refused_naming_what_to_do(how):
    # An ensemble step under vmap: the fused ops have no batching rule and the skip flag, the
    # clip norm and the q8 blocks are per tree; refused before any write, pointing at what
    # composes (vmap the gradients, step outside it).
    model, params, data = _func_setup()
    tx = af.mixed_precision(af.adamw(1e-3, moments="q8"), af.DynamicLossScale(), master="split")
    stacked = {k: torch.stack([v, v]) for k, v in params.items()}
    grads = {k: torch.ones_like(v) for k, v in stacked.items()}
    held = clone_tree(stacked)
    if how == "make_train_step":
        train = af.make_train_step(model, lambda fwd, x, y: F.cross_entropy(fwd(x).float(), y),
                                   af.adamw(1e-3, moments="q8"), "p=bf16,c=bf16,o=f32", master="split")
        state = train.init()
        x = torch.stack([data[0][0], data[1][0]])
        y = torch.stack([data[0][1], data[1][1]])
        with pytest.raises(ValueError, match=r"make_train_step: called under torch\.vmap.*vmap the gradients"):
            torch.vmap(train.step, in_dims=(None, 0, 0))(state, x, y)
        return
    state = tx.init(params)
    before = clone_tree(state)
    fn = tx.step if how == "step" else tx.step_
    with pytest.raises(ValueError, match=rf"mixed_precision\.{how}: called under torch\.vmap.*step outside it"):
        torch.vmap(fn, in_dims=(0, 0, None))(stacked, grads, state)
    assert same_tree_bits(stacked, held) and same_tree_bits(state, before)


def test_func_grad_around_a_step_is_not_refused_as_vmap():
    # the refusal is for vmap only: a step taken inside torch.func.grad's function (its result
    # unused by the gradient) still runs
    params = {"w": torch.randn(64, 64).bfloat16()}
    tx = af.mixed_precision(af.adamw(1e-3, moments="q8"), af.NoOpLossScale(), master="split")
    state = tx.init(params)

    def f(w):
        new, _ = tx.step({"w": w.detach()}, {"w": torch.ones(64, 64).bfloat16()}, state)
        return (w.float() * new["w"].float()).sum()

    g = grad(f)(params["w"])
    assert g.shape == (64, 64) and torch.isfinite(g.float()).all()
