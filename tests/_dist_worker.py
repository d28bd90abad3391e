"""One rank of the multi-process tests in ``test_distributed.py`` (launched like torchrun would).

Usage: ``RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/_dist_worker.py
SCENARIO OUTDIR``. Each scenario trains a tiny model over gloo on CPU, next to a single-process
reference run of the same global batch, and writes what it saw to ``OUTDIR/rank{r}.pt`` for the
test to compare. An inf is injected into the gradients of rank 1 only, at ``INJECT_STEP``.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.func import functional_call

if __name__ == "__main__":  # a rank: import the ampfunc the launching test imported (installed or a checkout)
    sys.path.insert(0, os.environ.get("AMPFUNC_TEST_IMPORT_ROOT")
                    or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ampfunc as af  # noqa: E402

STEPS = 6
INJECT_STEP = 3
GLOBAL_BATCH = 8


def net():
    torch.manual_seed(0)
    # 16 and 3 rows: FSDP2 shards them 8/8 and 2/1 over two ranks (an uneven shard included).
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def global_batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g))
            for _ in range(STEPS)]


def my_rows(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def loss_scale():
    return af.DynamicLossScale(2.0**10, growth_interval=2)


def poison(grad):
    """Puts an inf in the first element of a (local) gradient tensor."""
    with torch.no_grad():
        grad.view(-1)[0] = float("inf")


def reference_run(tx_factory, record_norm_at=None):
    """The same training as one process over the whole global batch, inf injected at INJECT_STEP."""
    model = net()
    trainer = af.ModuleTrainer(model, tx_factory(None), loss_scale=loss_scale())
    finite, scales, norm = [], [], None
    for step, (x, y) in enumerate(global_batches()):
        trainer.scale(F.cross_entropy(model(x), y)).backward()
        if step == record_norm_at:
            norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
        if step == INJECT_STEP:
            poison(model[0].weight.grad)
        finite.append(bool(trainer.step()))
        scales.append(float(trainer.loss_scale.loss_scale))
    return {"finite": finite, "scales": scales, "norm": norm,
            "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def scenario_ddp(env, out):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(net())
    trainer = af.ModuleTrainer(model, af.adamw(1e-2, weight_decay=0.01), loss_scale=loss_scale(), group=env.group)
    finite, scales = [], []
    for step, (x, y) in enumerate(global_batches()):
        x, y = my_rows(x, env.rank, env.world_size), my_rows(y, env.rank, env.world_size)
        trainer.scale(F.cross_entropy(model(x), y)).backward()  # DDP averages the grads here
        if step == INJECT_STEP and env.rank == 1:
            poison(model.module[0].weight.grad)  # after the all-reduce: only rank 1 sees it
        finite.append(bool(trainer.step()))
        scales.append(float(trainer.loss_scale.loss_scale))
    out.update(finite=finite, scales=scales,
               params={k.removeprefix("module."): v.detach().clone() for k, v in model.named_parameters()},
               reference=reference_run(lambda group: af.adamw(1e-2, weight_decay=0.01)))

    # Functional data parallelism without DDP: value_and_grad(group=) averages and agrees.
    model = net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = global_batches()[0]
    w = torch.tensor(float("inf") if env.rank == 1 else 1.0)

    def loss_fn(p, x, y, w):
        return F.cross_entropy(functional_call(model, p, (x,)), y) * w

    vg = af.value_and_grad(loss_fn, group=env.group)
    ls = af.StaticLossScale(2.0**8)
    rows = my_rows(x, env.rank, env.world_size), my_rows(y, env.rank, env.world_size)
    _, grads, finite_clean = vg(ls, params, *rows, torch.tensor(1.0))
    _, _, finite_poisoned = vg(ls, params, *rows, w)
    _, full_grads, _ = af.value_and_grad(loss_fn)(ls, params, x, y, torch.tensor(1.0))
    out.update(functional_grads=grads, functional_full_grads=full_grads,
               functional_finite=(bool(finite_clean), bool(finite_poisoned)))

    # make_train_step(group=): each rank steps on its rows, the run equals one process on all rows.
    def step_loss(forward, x, y, w):
        return F.cross_entropy(forward(x), y) * w

    def run_steps(group, rows):
        train = af.make_train_step(net(), step_loss, af.adam(1e-2), loss_scale=loss_scale(), group=group)
        state, finite = train.init(), []
        for step, (x, y) in enumerate(global_batches()):
            poisoned = step == INJECT_STEP and (group is None or env.rank == 1)
            w = torch.tensor(float("inf") if poisoned else 1.0)
            state, o = train.step(state, *rows(x, y), w)
            finite.append(bool(o.finite))
        return state.params, finite, float(state.loss_scale.loss_scale)

    mine = run_steps(env.group, lambda x, y: (my_rows(x, env.rank, env.world_size),
                                              my_rows(y, env.rank, env.world_size)))
    single = run_steps(None, lambda x, y: (x, y))
    out.update(train_step=mine, train_step_reference=single)

    # fp16 gradients that each fit but whose sum does not: averaged, not summed first.
    big = {"w": torch.full((4,), 40000.0, dtype=torch.float16)}
    out.update(fp16_mean=af.dist.all_reduce_mean(big, env.group)["w"])


def shard(model):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model


def fsdp_tx(group):
    return af.chain(af.clip_by_global_norm(0.05, group=group), af.adamw(1e-2, weight_decay=0.01))


def full_params(model):
    return {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}


def scenario_fsdp2(env, out):
    model = shard(net())
    trainer = af.ModuleTrainer(model, fsdp_tx(env.group), loss_scale=loss_scale(), group=env.group)
    finite, scales, local_finite_at_inject = [], [], None
    for step, (x, y) in enumerate(global_batches()):
        x, y = my_rows(x, env.rank, env.world_size), my_rows(y, env.rank, env.world_size)
        trainer.scale(F.cross_entropy(model(x), y)).backward()  # reduce-scatter: each rank its shards
        if step == 0:
            grads = {k: p.grad for k, p in model.named_parameters()}
            out["dtensor_grad_norm"] = af.optim.global_norm(grads)
            out["local_shard_grad_norm"] = af.optim.global_norm(af.dist.local_shards(grads), group=env.group)
            out["grad_placements"] = sorted({str(p.grad.placements) for p in model.parameters()})
        if step == INJECT_STEP:
            if env.rank == 1:
                poison(model[0].weight.grad.to_local())
            local = [p.grad.to_local() for p in model.parameters()]
            local_finite_at_inject = bool(af.tree.all_finite(local))
        finite.append(bool(trainer.step()))
        scales.append(float(trainer.loss_scale.loss_scale))
    out.update(finite=finite, scales=scales, params=full_params(model),
               local_finite_at_inject=local_finite_at_inject,
               reference=reference_run(fsdp_tx, record_norm_at=0))

    # distribute_tensor by hand: Shard(0) on an uneven tensor and Replicate count as whole tensors.
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (env.world_size,))
    torch.manual_seed(11)
    a, b = torch.randn(5, 3), torch.randn(4)
    tree = {"a": distribute_tensor(a, mesh, [Shard(0)]), "b": distribute_tensor(b, mesh, [Replicate()])}
    out["manual_dtensor_norm"] = af.optim.global_norm(tree)
    out["manual_full_norm"] = torch.cat([a.reshape(-1), b]).norm()
    try:
        af.optim.global_norm({"p": DTensor.from_local(b, mesh, [Partial()])})
        out["partial_error"] = None
    except ValueError as e:
        out["partial_error"] = str(e)


def scenario_checkpoint(env, out):
    directory = os.path.join(os.environ["AMPFUNC_TEST_OUT"], "ckpt")

    def train(model, trainer, steps):
        for x, y in steps:
            x, y = my_rows(x, env.rank, env.world_size), my_rows(y, env.rank, env.world_size)
            trainer.scale(F.cross_entropy(model(x), y)).backward()
            trainer.step()

    batches = global_batches()
    model = shard(net())
    trainer = af.ModuleTrainer(model, fsdp_tx(env.group), loss_scale=loss_scale(), group=env.group)
    train(model, trainer, batches[:3])
    af.dist.save_sharded({"params": af.params_of(model), "trainer": trainer.state}, directory)
    train(model, trainer, batches[3:])

    resumed = shard(net())
    resumed_trainer = af.ModuleTrainer(resumed, fsdp_tx(env.group), loss_scale=loss_scale(), group=env.group)
    loaded = af.dist.load_sharded(directory, like={"params": af.params_of(resumed), "trainer": resumed_trainer.state})
    af.functional.copy_to_module(resumed, loaded["params"])
    resumed_trainer.state = loaded["trainer"]
    train(resumed, resumed_trainer, batches[3:])
    out.update(uninterrupted=full_params(model), resumed=full_params(resumed),
               scales=(float(trainer.loss_scale.loss_scale), float(resumed_trainer.loss_scale.loss_scale)),
               files=sorted(os.listdir(directory)))

    # mixed_precision(...).step_ on the DTensor params themselves (no group: the mesh is in them),
    # the fused clip + AdamW; the state is saved per rank and resumed bit for bit, an inf on
    # rank 1 after the resume included.
    def mp_tx():
        return af.mixed_precision(af.chain(af.clip_by_global_norm(CLIP), af.adamw(LR, weight_decay=WD)),
                                  loss_scale())

    def mp_train(model, tx, state, steps, first):
        params = dict(model.named_parameters())
        for step, (x, y) in enumerate(steps, first):
            x, y = my_rows(x, env.rank, env.world_size), my_rows(y, env.rank, env.world_size)
            af.scale_loss(F.cross_entropy(model(x), y), af.loss_scale_of(state)).backward()
            if step == 4 and env.rank == 1:
                poison(model[0].weight.grad.to_local())
            _, state = tx.step_(params, {k: p.grad for k, p in params.items()}, state)
            model.zero_grad(set_to_none=True)
        return state

    mp_dir = os.path.join(os.environ["AMPFUNC_TEST_OUT"], "mp_ckpt")
    model, tx = shard(net()), mp_tx()
    state = tx.init(dict(model.named_parameters()))
    out["state_leaf_types"] = sorted({type(t).__name__ for t in af.tree.tree_leaves(state)
                                      if isinstance(t, torch.Tensor)})
    out["exp_avg_local_shape"] = tuple(state.inner[1].exp_avg["0.weight"].shape)
    state = mp_train(model, tx, state, batches[:3], 0)
    af.dist.save_sharded({"params": af.params_of(model), "state": state}, mp_dir)
    state = mp_train(model, tx, state, batches[3:], 3)

    resumed, tx2 = shard(net()), mp_tx()
    fresh = tx2.init(dict(resumed.named_parameters()))
    loaded = af.dist.load_sharded(mp_dir, like={"params": af.params_of(resumed), "state": fresh})
    af.functional.copy_to_module(resumed, loaded["params"])
    state2 = mp_train(resumed, tx2, loaded["state"], batches[3:], 3)
    out.update(mp_uninterrupted=full_params(model), mp_resumed=full_params(resumed),
               mp_state=[t.clone() for t in af.tree.tree_leaves(state) if isinstance(t, torch.Tensor)],
               mp_state_resumed=[t.clone() for t in af.tree.tree_leaves(state2) if isinstance(t, torch.Tensor)],
               mp_skipped=(int(state.skipped), int(state2.skipped)))


# ----------------------------------------------------------------------------------------------
# Every path (update, step, step_, make_train_step, ModuleTrainer) under DDP, FSDP2 with DTensor
# params, and FSDP2's local shards, against one process running torch on the whole batch
# ----------------------------------------------------------------------------------------------

LR, WD, CLIP = 1e-2, 0.01, 0.05  # the clip is active at every step (the grad norms are ~0.5-2)


def torch_reference():
    """torch.optim.AdamW + clip_grad_norm_ on the global batch, one process; the step where any
    rank saw an inf is skipped (as GradScaler skips it). Returns the params after every step."""
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    params = []
    for step, (x, y) in enumerate(global_batches()):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if step != INJECT_STEP:
            opt.step()
        params.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return params


def _dtensor_api():
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor, Replicate, Shard, distribute_tensor
    return init_device_mesh, DTensor, Replicate, Shard, distribute_tensor


def _full(t):
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def _record(rec, named, finite, scale):
    rec["params"].append({k: _full(v) for k, v in named})
    rec["finite"].append(bool(finite))
    rec["scale"].append(float(scale))


def _new_record():
    return {"params": [], "finite": [], "scale": []}


def _pure_path(env, setting, path):
    """mixed_precision's update / step / step_ on a DDP module, an FSDP2 module's DTensor params,
    or their local shards; the loss scaled by hand, the gradients from .grad."""
    if setting == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(net())
        named = list(model.module.named_parameters())
        tx = af.mixed_precision(af.chain(af.clip_by_global_norm(CLIP), af.adamw(LR, weight_decay=WD)),
                                loss_scale(), group=env.group)
        view = lambda t: t  # noqa: E731
    elif setting == "fsdp2":
        model = shard(net())
        named = list(model.named_parameters())
        # no group: the mesh is in the DTensors; the flag and the clip's norm are reduced over it
        tx = af.mixed_precision(af.chain(af.clip_by_global_norm(CLIP), af.adamw(LR, weight_decay=WD)),
                                loss_scale())
        view = lambda t: t  # noqa: E731
    else:  # FSDP2's local shards: plain tensors, the group given to the flag and to the norm
        model = shard(net())
        named = list(model.named_parameters())
        tx = af.mixed_precision(af.chain(af.clip_by_global_norm(CLIP, group=env.group),
                                         af.adamw(LR, weight_decay=WD)), loss_scale(), group=env.group)
        view = lambda t: t.detach().to_local()  # noqa: E731  (an alias of the shard, outside autograd)
    params = {k: view(p) for k, p in named}
    state = tx.init(params)
    rec = _new_record()
    for step, (x, y) in enumerate(global_batches()):
        x, y = my_rows(x, env.rank, env.world_size), my_rows(y, env.rank, env.world_size)
        af.scale_loss(F.cross_entropy(model(x), y), af.loss_scale_of(state)).backward()
        if step == INJECT_STEP and env.rank == 1:
            poison(view(named[0][1].grad) if setting != "fsdp2" else named[0][1].grad.to_local())
        grads = {k: view(p.grad) for k, p in named}
        if path == "update":
            updates, state = tx.update(grads, state, params)
            new = af.apply_updates(params, updates)
        elif path == "step":
            new, state = tx.step(params, grads, state)
        else:
            new, state = tx.step_(params, grads, state)
            assert new is params
        if path != "step_":
            if setting == "fsdp2":
                assert all(type(v).__name__ == "DTensor" and v.placements == params[k].placements
                           for k, v in new.items()), {k: type(v) for k, v in new.items()}
            with torch.no_grad():
                for k, p in named:
                    view(p).copy_(new[k])
            params = {k: view(p) for k, p in named}
        model.zero_grad(set_to_none=True)
        _record(rec, named, state.finite, af.loss_scale_of(state).loss_scale)
    return rec


def _trainer_path(env, setting):
    if setting == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(net())
        named = list(model.module.named_parameters())
        trainer = af.ModuleTrainer(model, af.chain(af.clip_by_global_norm(CLIP), af.adamw(LR, weight_decay=WD)),
                                   loss_scale=loss_scale(), group=env.group)
    else:
        model = shard(net())
        named = list(model.named_parameters())
        clip = af.clip_by_global_norm(CLIP) if setting == "fsdp2" else af.clip_by_global_norm(CLIP, group=env.group)
        trainer = af.ModuleTrainer(model, af.chain(clip, af.adamw(LR, weight_decay=WD)), loss_scale=loss_scale(),
                                   group=None if setting == "fsdp2" else env.group)
    rec = _new_record()
    for step, (x, y) in enumerate(global_batches()):
        x, y = my_rows(x, env.rank, env.world_size), my_rows(y, env.rank, env.world_size)
        trainer.scale(F.cross_entropy(model(x), y)).backward()
        if step == INJECT_STEP and env.rank == 1:
            g = named[0][1].grad
            poison(g.to_local() if hasattr(g, "to_local") else g)
        finite = trainer.step()
        _record(rec, named, finite, trainer.loss_scale.loss_scale)
    return rec


def _train_step_path(env, setting, inplace):
    """make_train_step. DDP: a plain module, group= averaging the gradients as DDP would. FSDP2
    with DTensors: a module whose params are Shard(0) DTensors (FSDP2's layout, without
    fully_shard's hooks, which functional_call bypasses) and a batch sharded on its rows."""
    def loss_fn(forward, x, y, w):
        return F.cross_entropy(forward(x), y) * w

    tx = af.chain(af.clip_by_global_norm(CLIP), af.adamw(LR, weight_decay=WD))
    model = net()
    if setting == "fsdp2":
        init_device_mesh, DTensor, _, Shard, distribute_tensor = _dtensor_api()
        mesh = init_device_mesh("cpu", (env.world_size,))
        for mod in model.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        train = af.make_train_step(model, loss_fn, tx, loss_scale=loss_scale())

        def rows(t):
            return DTensor.from_local(my_rows(t, env.rank, env.world_size), mesh, [Shard(0)])
    else:
        train = af.make_train_step(model, loss_fn, tx, loss_scale=loss_scale(), group=env.group)

        def rows(t):
            return my_rows(t, env.rank, env.world_size)
    state = train.init()
    step_fn = train.step_ if inplace else train.step
    rec = _new_record()
    for step, (x, y) in enumerate(global_batches()):
        w = torch.tensor(float("inf") if step == INJECT_STEP and env.rank == 1 else 1.0)
        state, o = step_fn(state, rows(x), rows(y), w)
        _record(rec, state.params.items(), o.finite, state.loss_scale.loss_scale)
    return rec


def _refusals(env):
    """Bad input at the front doors: refused naming the leaf, nothing written."""
    init_device_mesh, DTensor, Replicate, Shard, distribute_tensor = _dtensor_api()
    mesh = init_device_mesh("cpu", (env.world_size,))
    other = init_device_mesh("cpu", (env.world_size, 1))
    a = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    out = {}

    def error_of(fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            return str(e)
        return None

    tx = af.mixed_precision(af.adamw(LR), af.NoOpLossScale())
    mixed = {"a": a, "b": torch.ones(3)}
    out["mixed_init"] = error_of(lambda: tx.init(mixed))
    state = tx.init({"a": a})
    before = a.to_local().clone()
    out["mixed_step_"] = error_of(lambda: tx.step_(mixed, {"a": a, "b": torch.ones(3)}, state))
    out["plain_grad"] = error_of(lambda: tx.step_({"a": a}, {"a": torch.ones(2, 2)}, state))
    out["dtensor_grad_plain_param"] = error_of(lambda: tx.step({"b": torch.ones(3)}, {"b": a}, tx.init(
        {"b": torch.ones(3)})))
    meshes = {"a": a, "c": distribute_tensor(torch.ones(4), other, [Shard(0), Replicate()])}
    out["two_meshes"] = error_of(lambda: tx.init(meshes))
    model = shard(net())
    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    out["trainer_mixed"] = error_of(lambda: af.ModuleTrainer(model, af.adamw(LR)))
    # a Partial param holds partial sums: refused, naming it
    try:
        from torch.distributed.tensor import Partial
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import Partial
    out["partial"] = error_of(lambda: tx.init({"p": DTensor.from_local(torch.ones(2), mesh, [Partial()])}))
    # leaves of different layouts in one step (an uneven Shard(0) and a Replicate): the clip's norm
    # counts each whole tensor once, on the fused path (sgd) and the generic one (a clip with no kernel)
    torch.manual_seed(5)
    full = {"s": torch.randn(5, 3), "r": torch.randn(4)}
    grads = {"s": torch.randn(5, 3), "r": torch.randn(4)}
    placements = {"s": [Shard(0)], "r": [Replicate()]}
    dparams = {k: distribute_tensor(v, mesh, placements[k]) for k, v in full.items()}
    dgrads = {k: distribute_tensor(v, mesh, placements[k]) for k, v in grads.items()}
    norm = torch.cat([g.reshape(-1) for g in grads.values()]).norm()
    coef = min(1.0, 0.1 / (float(norm) + 1e-6))
    want = {k: full[k] - coef * grads[k] for k in full}
    diffs = []
    for clip in (af.clip_by_global_norm(0.1), af.GradientTransformation(af.clip_by_global_norm(0.1).init,
                                                                        af.clip_by_global_norm(0.1).update)):
        mp = af.mixed_precision(af.chain(clip, af.sgd(1.0)), af.NoOpLossScale())
        new, _ = mp.step(dparams, dgrads, mp.init(dparams))
        diffs.append(max(float((new[k].full_tensor() - want[k]).abs().max()) for k in want))
    out["mixed_layout_diffs"] = diffs
    # fully_shard's hooks gather their own params, bypassing functional_call's: refused
    out["fsdp2_module"] = error_of(lambda: af.make_train_step(shard(net()), lambda f, x: f(x).sum(), af.adamw(LR)))
    out["untouched"] = torch.equal(a.to_local(), before) and int(state.skipped) == 0
    return out


def scenario_paths(env, out):
    reference = torch_reference()
    table, calls = {}, {}
    counted = [0]

    def counting(fn):
        def call(*args, **kwargs):
            counted[0] += 1
            return fn(*args, **kwargs)
        return call

    # the fused optimizer kernels, counted: each step of a kernel-backed path calls one of them
    for name in ("adam_step", "adam_step_", "adam_step_checked"):
        setattr(af.ops, name, counting(getattr(af.ops, name)))

    def run(key, fn, *args, **kwargs):
        counted[0] = 0
        table[key] = fn(env, *args, **kwargs)
        calls[key] = counted[0]

    for setting in ("ddp", "fsdp2", "local"):
        for path in ("update", "step", "step_"):
            run((setting, path), _pure_path, setting, path)
        run((setting, "ModuleTrainer"), _trainer_path, setting)
    for setting in ("ddp", "fsdp2"):
        run((setting, "make_train_step"), _train_step_path, setting, inplace=False)
        run((setting, "make_train_step.step_"), _train_step_path, setting, inplace=True)
    out.update(reference=reference, table=table, kernel_calls=calls, refusals=_refusals(env))


def scenario_misuse(env, out):
    """What goes wrong across ranks is refused by name, the same way on every rank."""
    def error_of(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    # rank 1's leaf 'b' has another shape (same element count): averaged in one buffer, the
    # values of different leaves would mix
    shapes = {"a": (3,), "b": (2,)} if env.rank == 0 else {"a": (4,), "b": (1,)}
    tree = {k: torch.full(s, float(env.rank + 1)) for k, s in shapes.items()}
    out["layout_error"] = error_of(lambda: af.dist.all_reduce_mean(tree, env.group))
    # the same layout passes (and is checked once)
    same = {"a": torch.full((3,), float(env.rank + 1))}
    out["mean"] = af.dist.all_reduce_mean(same, env.group)["a"]
    # rank 1 is outside a group of rank 0 alone: refused there, a no-op average on rank 0
    solo = dist.new_group([0])
    out["nonmember_error"] = error_of(lambda: af.dist.all_reduce_mean(same, solo))
    out["nonmember_flag_error"] = error_of(lambda: af.dist.agree_finite(torch.tensor(True), solo))
    # fp8: a NaN amax on the higher rank reaches every rank (gloo's MAX drops it there)
    from ampfunc import fp8 as af_fp8
    x = torch.tensor([1.0, 2.0]) if env.rank == 0 else torch.tensor([float("nan"), 3.0])
    out["fp8_amax"] = af_fp8._amax(x, env.group)
    # and an inf stays inf (not fp32's largest number, which would be recorded as an amax)
    x = torch.tensor([1.0, float("inf")]) if env.rank == 0 else torch.tensor([2.0, 3.0])
    out["fp8_amax_inf"] = af_fp8._amax(x, env.group)


def main():
    scenario, outdir = sys.argv[1], sys.argv[2]
    os.environ["AMPFUNC_TEST_OUT"] = outdir
    env = af.dist.init_from_env()
    out = {"rank": env.rank, "world_size": env.world_size}
    try:
        {"ddp": scenario_ddp, "fsdp2": scenario_fsdp2, "checkpoint": scenario_checkpoint,
         "misuse": scenario_misuse, "paths": scenario_paths}[scenario](env, out)
        torch.save(out, os.path.join(outdir, f"rank{env.rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
