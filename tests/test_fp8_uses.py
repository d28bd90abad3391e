"""FP8 layers used in ways beyond one plain forward (ampfunc/fp8.py): a compiled step whose weights
are differentiated directly, several uses of one scaling state before one backward (combined by
max), a Linear tied to another parameter, and activation checkpointing.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad
from torch.utils.checkpoint import checkpoint

import ampfunc as af
from ampfunc import fp8 as f8


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))


def batches(n, batch=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 32, generator=g) * (1 + i), torch.randint(0, 10, (batch,), generator=g))
            for i in range(n)]


def leaves(tree):
    return af.tree.tree_leaves(tree)


def assert_trees_equal(a, b):
    for u, v in zip(leaves(a), leaves(b), strict=True):
        assert torch.equal(u, v)


# -- compiled: weights differentiated directly, a first layer whose input needs no grad -------------


def run_train_step(step, train, data):
    state = train.init()
    flags = []
    for x, y in data:
        state, out = step(state, x, y)
        flags.append(bool(out.finite))
    return state, flags


def fp8_train(model):
    # The params are cast outside the differentiated function, so torch.func.grad differentiates
    # the weights themselves; layer "0"'s input is the batch (no grad).
    pol = f8.fp8_policy(model, exclude=("4",))
    return af.make_train_step(model, lambda fwd, x, y: F.cross_entropy(fwd(x), y), af.adamw(1e-3),
                              "p=f32,c=bf16,o=f32", loss_scale=af.DynamicLossScale(), fp8=pol)


def eager_and_compiled(steps, **compile_kwargs):
    """An fp8 ``make_train_step`` run for ``steps`` batches eagerly and compiled (fullgraph):
    ``(train, data, (eager state, flags), (compiled state, flags))``."""
    torch._dynamo.reset()
    train = fp8_train(mlp())
    data = batches(steps)
    eager = run_train_step(train.step, train, data)
    return train, data, eager, run_train_step(torch.compile(train.step, fullgraph=True, **compile_kwargs), train, data)


@pytest.mark.slow
def test_compiled_step_runs_the_fp8_backward_of_a_directly_differentiated_first_layer():
    _, data, (eager, eager_flags), (comp, comp_flags) = eager_and_compiled(4, backend="aot_eager")
    assert eager_flags == comp_flags == [True] * 4
    expected = max(float(x.bfloat16().abs().max()) for x, _ in data)
    assert float(comp.fp8["0"].input.amax_history.max()) == expected  # not the zeros of a skipped backward
    for a, b in zip(leaves((eager.params, eager.fp8, eager.opt_state)),
                    leaves((comp.params, comp.fp8, comp.opt_state))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compiled_grad_of_fp8_apply_over_fp32_params_returns_the_new_state():
    torch._dynamo.reset()
    model = mlp()
    pol = f8.fp8_policy(model, exclude=("4",))
    params = {k: v.clone() for k, v in af.params_of(model).items()}
    x, y = batches(1)[0]

    def grads(p, s):
        return grad(lambda p, s: F.cross_entropy(pol.apply(model, p, s, x), y), argnums=(0, 1))(p, s)

    eager = grads(params, pol.init())
    comp = torch.compile(grads, fullgraph=True, backend="aot_eager")(params, pol.init())
    assert float(comp[1]["0"].input.amax_history[0]) == float(x.abs().max())
    for a, b in zip(leaves(eager), leaves(comp)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_inductor_step_with_fp8_steps_like_eager():
    # Before: inductor differentiated through the forward's quantisation and every step overflowed.
    train, data, (eager, eager_flags), (comp, comp_flags) = eager_and_compiled(3)
    start = train.init()
    assert eager_flags == comp_flags == [True] * 3
    assert float(comp.loss_scale.loss_scale) == float(eager.loss_scale.loss_scale) == 65536.0
    # Not bit for bit: inductor fuses the bf16 pointwise ops around the FP8 layers (which alone
    # match exactly) in fp32, and the fp8 roundings (12.5% steps in e4m3, 25% in e5m2) amplify a
    # one-ulp difference: the state within 10%, the updates in the same direction (a batch
    # scaled by 1 + 2**-8 in eager gives cosine 0.99; a skipped step gives no update at all).
    for name in eager.fp8:
        for a, b in zip(leaves(eager.fp8[name]), leaves(comp.fp8[name])):
            torch.testing.assert_close(a, b, rtol=0.1, atol=0)

    def update(state):
        return torch.cat([(a - b).flatten() for a, b in zip(leaves(state.params), leaves(start.params))])

    u, v = update(eager), update(comp)
    assert float(u @ v / (u.norm() * v.norm())) > 0.95


# -- several uses of one state before one backward: amaxes combine by max ---------------------------


def one_layer_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))


def combined_by_max(a: f8.Fp8LinearState, b: f8.Fp8LinearState) -> f8.Fp8LinearState:
    """What advancing one initial state with max(amax_a, amax_b) gives, from the states that
    advancing it with amax_a and with amax_b gave: per operand, the one with the larger amax."""
    return f8.Fp8LinearState(*(u if u.amax_history[0] >= v.amax_history[0] else v for u, v in zip(a, b)))


def test_make_train_step_forwarding_twice_records_the_max_of_both_amaxes():
    model = one_layer_model()
    pol = f8.fp8_policy(model, exclude=("2",), backend="emulate")
    (x1, y1), (x2, y2) = batches(2, batch=8)

    def step(loss_fn, *batch):
        train = af.make_train_step(model, loss_fn, af.sgd(0.0), "p=f32,c=f32,o=f32", fp8=pol)
        return train.step(train.init(), *batch)[0].fp8["0"]

    single = lambda fwd, x, y: F.cross_entropy(fwd(x), y)
    both = step(lambda fwd, x1, x2, y1, y2: single(fwd, x1, y1) + single(fwd, x2, y2), x1, x2, y1, y2)
    assert_trees_equal(both, combined_by_max(step(single, x1, y1), step(single, x2, y2)))
    # (the input's amaxes differ: x2 is twice as wide; a sum would have recorded 3x)
    assert float(both.input.amax_history[0]) == float(x2.abs().max()) != float(x1.abs().max())


@pytest.mark.slow
def test_compiled_make_train_step_forwarding_twice_equals_eager():
    torch._dynamo.reset()
    model = one_layer_model()
    pol = f8.fp8_policy(model, exclude=("2",), backend="emulate")
    def two_batch_loss(fwd, x1, x2, y1, y2):
        return F.cross_entropy(fwd(x1), y1) + F.cross_entropy(fwd(x2), y2)

    train = af.make_train_step(model, two_batch_loss, af.sgd(0.0), "p=f32,c=f32,o=f32", fp8=pol)
    (x1, y1), (x2, y2) = batches(2, batch=8)
    eager, _ = train.step(train.init(), x1, x2, y1, y2)
    comp, _ = torch.compile(train.step, fullgraph=True, backend="aot_eager")(train.init(), x1, x2, y1, y2)
    assert_trees_equal(eager.fp8, comp.fp8)
    assert float(comp.fp8["0"].input.amax_history[0]) == float(x2.abs().max())


def test_gradient_accumulation_with_backward_per_micro_batch_records_the_max():
    # The README's .backward() recipe: track once, autocast and backward per micro-batch, from_grads.
    (x1, y1), (x2, y2) = batches(2, batch=8)

    def accumulate(micro_batches):
        model = one_layer_model()
        pol = f8.fp8_policy(model, exclude=("2",), backend="emulate")
        live = pol.track(pol.init())
        for x, y in micro_batches:
            with pol.autocast(model, live):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        return pol.from_grads(live)["0"], model[0].weight.grad

    both, wgrad = accumulate([(x1, y1), (x2, y2)])
    (one, g1), (two, g2) = accumulate([(x1, y1)]), accumulate([(x2, y2)])
    assert_trees_equal(both, combined_by_max(one, two))
    assert torch.equal(wgrad, g1 + g2)  # the parameter gradients still add up
    assert not any(t.requires_grad for t in leaves(both))


def test_one_context_around_a_backward_per_micro_batch_records_the_max():
    # One autocast around the whole accumulation loop: a backward frees the chain of uses, so
    # the next forward starts a new one (it used to chain to the freed graph and fail)
    (x1, y1), (x2, y2) = batches(2, batch=8)

    def accumulate(micro_batches, one_context):
        model = one_layer_model()
        pol = f8.fp8_policy(model, exclude=("2",), backend="emulate")
        live = pol.track(pol.init())
        with pol.autocast(model, live) if one_context else contextlib.nullcontext():
            for x, y in micro_batches:
                with contextlib.nullcontext() if one_context else pol.autocast(model, live):
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
        return pol.from_grads(live)["0"], model[0].weight.grad

    one_ctx, g_one = accumulate([(x1, y1), (x2, y2)], True)
    per_ctx, g_per = accumulate([(x1, y1), (x2, y2)], False)
    assert_trees_equal(one_ctx, per_ctx)
    assert torch.equal(g_one, g_per)


def test_two_contexts_before_one_backward_on_a_tracked_state_record_the_max():
    model = one_layer_model()
    pol = f8.fp8_policy(model, exclude=("2",), backend="emulate")
    (x1, y1), (x2, y2) = batches(2, batch=8)
    live = pol.track(pol.init())
    losses = []
    for x, y in [(x1, y1), (x2, y2)]:
        with pol.autocast(model, live):
            losses.append(F.cross_entropy(model(x), y))
    sum(losses).backward()
    got = pol.from_grads(live)["0"]

    ref = af.make_train_step(model, lambda fwd, x, y: F.cross_entropy(fwd(x), y), af.sgd(0.0), "p=f32,c=f32,o=f32",
                             fp8=pol)
    one, two = (ref.step(ref.init(), x, y)[0].fp8["0"] for x, y in [(x1, y1), (x2, y2)])
    assert_trees_equal(got, combined_by_max(one, two))


class Looped(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared, self.head = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.shared(torch.relu(self.shared(x)))))


def test_a_layer_run_twice_in_one_forward_records_the_max_of_its_uses():
    model = Looped()
    pol = f8.fp8_policy(model, exclude=("head",), backend="emulate")
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    _, new8 = grad(lambda p, s: F.cross_entropy(pol.apply(model, p, s, x), y), argnums=(0, 1))(
        af.params_of(model), pol.init())
    # The stateful path (module hooks see each use) gives the same state, bit for bit.
    inputs, out_grads = [], []
    model.shared.register_forward_hook(lambda m, i, o: inputs.append(i[0].detach()))
    model.shared.register_full_backward_hook(lambda m, gi, go: out_grads.append(go[0].detach()))
    live = pol.track(pol.init())
    with pol.autocast(model, live):
        F.cross_entropy(model(x), y).backward()
    assert_trees_equal(pol.from_grads(live), new8)
    st = new8["shared"]
    assert len(inputs) == len(out_grads) == 2
    assert float(st.input.amax_history[0]) == max(float(t.abs().max()) for t in inputs)
    assert float(st.grad_output.amax_history[0]) == max(float(t.abs().max()) for t in out_grads)
    assert float(st.weight.amax_history[0]) == float(model.shared.weight.abs().max())  # once, not twice


def test_two_fp8_apply_calls_over_one_state_in_one_backward_are_refused_by_name():
    model = one_layer_model()
    pol = f8.fp8_policy(model, exclude=("2",), backend="emulate")
    (x1, y1), (x2, y2) = batches(2, batch=8)
    params = af.params_of(model)

    def two_applies(p, s):
        return (F.cross_entropy(pol.apply(model, p, s, x1), y1) + F.cross_entropy(pol.apply(model, p, s, x2), y2))

    with pytest.raises(RuntimeError, match=r"layer '0' was used by two separate FP8 contexts.*fp8.autocast"):
        grad(two_applies, argnums=(0, 1))(params, pol.init())

    def one_context(p, s):  # the way the message names
        with pol.autocast(model, s, p):
            return (F.cross_entropy(functional_call(model, p, (x1,)), y1)
                    + F.cross_entropy(functional_call(model, p, (x2,)), y2))

    _, new8 = grad(one_context, argnums=(0, 1))(params, pol.init())
    assert float(new8["0"].input.amax_history[0]) == float(x2.abs().max())


# -- a Linear tied to another parameter -------------------------------------------------------------


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid, self.head = nn.Embedding(30, 16), nn.Linear(16, 16), nn.Linear(16, 30, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))


def test_a_linear_tied_to_an_embedding_runs_in_fp8_on_every_path():
    model = TiedLM()
    pol = f8.fp8_policy(model, backend="emulate")
    assert pol.layers == ("mid", "head") and "head.weight" not in af.params_of(model)
    x, y = torch.randint(0, 30, (4, 7)), torch.randint(0, 30, (4, 7))
    loss = lambda out: F.cross_entropy(out.reshape(-1, 30), y.reshape(-1))
    params = af.params_of(model)
    grads, new8 = grad(lambda p, s: loss(pol.apply(model, p, s, x)), argnums=(0, 1))(params, pol.init())
    assert float(new8["head"].input.amax_history[0]) > 0  # it ran in FP8
    # the same numbers as the stateful path, which uses the module's own (tied) Parameter
    live = pol.track(pol.init())
    with pol.autocast(model, live):
        loss(model(x)).backward()
    assert_trees_equal(pol.from_grads(live), new8)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    # and make_train_step's state advances it too
    train = af.make_train_step(model, lambda fwd, x, y: loss(fwd(x)), af.sgd(0.0), "p=f32,c=f32,o=f32", fp8=pol)
    st, _ = train.step(train.init(), x, y)
    assert_trees_equal(st.fp8, new8)


def test_linears_sharing_one_weight_are_refused_by_name():
    model = Looped()
    model.other = nn.Linear(8, 8)
    model.other.weight = model.shared.weight
    with pytest.raises(ValueError, match=r"\['shared', 'other'\] share one weight"):
        f8.fp8_policy(model, exclude=("head",))
    with pytest.raises(ValueError, match=r"share one weight"):  # an excluded one would still run in FP8
        f8.fp8_policy(model, exclude=("head", "other"))
    assert f8.fp8_policy(model, exclude=("shared", "other")).layers == ("head",)


# -- activation checkpointing ------------------------------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.reentrant = nn.Linear(32, 64), nn.Linear(64, 10), reentrant

    def forward(self, x):
        return self.b(checkpoint(lambda t: F.gelu(self.a(t)), x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_layer_checkpointed_inside_the_fp8_context_is_refused_by_name(reentrant):
    # The recomputation would run it outside the context, as a plain F.linear.
    model = Checkpointed(reentrant)
    pol = f8.fp8_policy(model, exclude=("b",), backend="emulate")
    train = af.make_train_step(model, lambda fwd, x, y: F.cross_entropy(fwd(x), y), af.sgd(0.1), fp8=pol)
    state = train.init()
    before = [t.clone() for t in leaves(state)]
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    with pytest.raises(RuntimeError, match=r"layer 'a' runs inside torch.utils.checkpoint"):
        train.step(state, x, y)
    assert_trees_equal(before, leaves(state))
    live = pol.track(pol.init())
    with pytest.raises(RuntimeError, match=r"layer 'a' runs inside torch.utils.checkpoint"), pol.autocast(model, live):
        model(x)


def test_checkpointing_a_region_that_enters_fp8_itself_matches_no_checkpoint():
    model = one_layer_model()
    pol = f8.fp8_policy(model, exclude=("2",), backend="emulate")
    x, y = batches(1, batch=8)[0]

    def run(wrap):
        params = {k: v.detach().requires_grad_() for k, v in af.params_of(model).items()}
        live = pol.track(pol.init())
        F.cross_entropy(wrap(lambda t: pol.apply(model, params, live, t), x), y).backward()
        return {k: p.grad for k, p in params.items()}, pol.from_grads(live)

    plain = run(lambda f, t: f(t))
    checkpointed = run(lambda f, t: checkpoint(f, t, use_reentrant=False))
    assert_trees_equal(plain, checkpointed)
