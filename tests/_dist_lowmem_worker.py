"""One rank of the low-memory multi-process tests in ``test_lowmem_compose.py``.

Usage as ``_dist_worker.py`` (``RANK``/``WORLD_SIZE``/``MASTER_*`` set, ``SCENARIO OUTDIR``). The
low-memory settings (``master="split"``, ``moments="q8"|"bf16"``) under DDP and FSDP2 on bf16
params, each path next to one process running the same settings on the concatenated batch. An
inf is injected into rank 1's gradients only, at ``INJECT_STEP``.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

if __name__ == "__main__":  # a rank: import the ampfunc the launching test imported
    sys.path.insert(0, os.environ.get("AMPFUNC_TEST_IMPORT_ROOT")
                    or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ampfunc as af  # noqa: E402
from _dist_worker import _dtensor_api, my_rows, poison, shard  # noqa: E402

STEPS = 6
INJECT_STEP = 3
GLOBAL_BATCH = 8
LR, WD = 1e-3, 0.01


def net():
    """bf16 layers sized for the q8 rule: '0.weight' (256 x 32) and '2.weight' (32 x 256) have 8,192
    elements, and each rank's shard of them 4,096 (q8 whole and per shard, the shards starting
    on a block boundary: the blocks are the whole tensor's); the biases and '4.weight' (3 x 32)
    are small (fp32 moments)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 3)).to(torch.bfloat16)


def global_batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(GLOBAL_BATCH, 32, generator=g).bfloat16(), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g))
            for _ in range(STEPS)]


def loss_scale():
    return af.DynamicLossScale(2.0**10, growth_interval=2)


def opt(moments):
    return af.adamw(LR, weight_decay=WD, moments=moments)


def _local(t):
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def _full(local, like):
    """The whole tensor of a local shard laid out as the DTensor ``like`` (``local`` if plain)."""
    if not hasattr(like, "to_local"):
        return local.detach().clone()
    DTensor = _dtensor_api()[1]
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride()).full_tensor()


def _tensors(tree):
    return [t.detach().clone() for t in af.tree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _opt_state(state):
    """The optimizer state of a MixedPrecisionState, TrainState or TrainerState."""
    return state.inner if hasattr(state, "inner") else state.opt_state


# The gradients each low-memory step was fed (local shards under FSDP2, after DDP's average):
# the test steps one process on the whole tensors with them.
_FED = [[]]
_lowmem_step = af.engine.lowmem_step


def _recording_lowmem_step(core, plan, split, params, grads, state, **kw):
    _FED[0].append({p: g.detach().clone() for p, g in af.tree.leaves_with_paths(grads)})
    return _lowmem_step(core, plan, split, params, grads, state, **kw)


if __name__ == "__main__":  # in a rank only: a test process importing this module keeps the engine as it is
    af.engine.lowmem_step = _recording_lowmem_step


def _record(rec, named, state, finite, scale):
    """After a step: the whole fp32 masters, the whole bf16 params, this rank's state tensors."""
    local = {k: _local(p) for k, p in named}
    masters = af.master_params(local, state)
    like = dict(named)
    rec["masters"].append({k: _full(m, like[k]) for k, m in masters.items()})
    rec["params"].append({k: _full(v, like[k]) for k, v in local.items()})
    rec["state"].append(_tensors((state.master, _opt_state(state))))
    rec["finite"].append(bool(finite))
    rec["scale"].append(float(scale))


def _new_record():
    _FED[0] = []
    return {"masters": [], "params": [], "state": [], "finite": [], "scale": [], "grads": _FED[0]}


def reference(moments):
    """One process, the same settings on the whole batch (mixed_precision(...).step_ on the bf16
    module), the step where rank 1 saw an inf skipped by injecting it here."""
    model = net()
    named = list(model.named_parameters())
    tx = af.mixed_precision(opt(moments), loss_scale(), master="split")
    params = dict(named)
    state = tx.init(params)
    rec = _new_record()
    for step, (x, y) in enumerate(global_batches()):
        af.scale_loss(F.cross_entropy(model(x).float(), y), af.loss_scale_of(state)).backward()
        if step == INJECT_STEP:
            poison(named[0][1].grad)
        with torch.no_grad():
            _, state = tx.step_(params, {k: p.grad for k, p in named}, state)
        model.zero_grad(set_to_none=True)
        _record(rec, named, state, state.finite, af.loss_scale_of(state).loss_scale)
    rec["q8_leaves"] = sorted(k for k, c in state.inner.exp_avg.codes.items() if c.dtype == torch.uint8) \
        if moments == "q8" else []
    return rec


def _model(setting):
    model = net()
    if setting == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model)
    return shard(model)


def _pure_path(env, setting, path, moments):
    """mixed_precision(adamw(moments=...), master="split") step / step_ on a DDP module's params
    (group=) or an FSDP2 module's DTensor params (no group: the mesh is in them)."""
    model = _model(setting)
    named = list((model.module if setting == "ddp" else model).named_parameters())
    tx = af.mixed_precision(opt(moments), loss_scale(), master="split",
                            group=env.group if setting == "ddp" else None)
    params = dict(named)
    state = tx.init(params)
    rec = _new_record()
    for step, (x, y) in enumerate(global_batches()):
        x, y = my_rows(x, env.rank, env.world_size), my_rows(y, env.rank, env.world_size)
        af.scale_loss(F.cross_entropy(model(x).float(), y), af.loss_scale_of(state)).backward()
        if step == INJECT_STEP and env.rank == 1:
            poison(_local(named[0][1].grad))
        grads = {k: p.grad for k, p in named}
        with torch.no_grad():
            if path == "step":
                new, state = tx.step(params, grads, state)
                for k, p in named:
                    p.copy_(new[k])
            else:
                _, state = tx.step_(params, grads, state)
        model.zero_grad(set_to_none=True)
        _record(rec, named, state, state.finite, af.loss_scale_of(state).loss_scale)
    return rec


def _trainer_path(env, setting, moments):
    model = _model(setting)
    named = list(model.named_parameters())  # the trainer's names (DDP's "module." included)
    trainer = af.ModuleTrainer(model, opt(moments), loss_scale=loss_scale(), master="split",
                               group=env.group if setting == "ddp" else None)
    rec = _new_record()
    for step, (x, y) in enumerate(global_batches()):
        x, y = my_rows(x, env.rank, env.world_size), my_rows(y, env.rank, env.world_size)
        trainer.scale(F.cross_entropy(model(x).float(), y)).backward()
        if step == INJECT_STEP and env.rank == 1:
            poison(_local(named[0][1].grad))
        finite = trainer.step()
        _record(rec, named, trainer.state, finite, trainer.loss_scale.loss_scale)
    rec["masters"] = [{k.removeprefix("module."): v for k, v in m.items()} for m in rec["masters"]]
    rec["params"] = [{k.removeprefix("module."): v for k, v in m.items()} for m in rec["params"]]
    rec["grads"] = [{k.removeprefix("module."): v for k, v in m.items()} for m in rec["grads"]]
    return rec


def _train_step_path(env, setting, inplace, moments):
    """make_train_step(master="split"), policy "p=bf16,c=bf16,o=f32". DDP: the plain module with
    group= (it averages the gradients as DDP does). FSDP2: a module whose params are Shard(0)
    DTensors (fully_shard's layout without its hooks) and a batch sharded on its rows."""
    def loss_fn(forward, x, y, w):
        return F.cross_entropy(forward(x), y) * w

    model = net()
    kw = dict(policy="p=bf16,c=bf16,o=f32", loss_scale=loss_scale(), master="split")
    if setting == "fsdp2":
        init_device_mesh, DTensor, _, Shard, distribute_tensor = _dtensor_api()
        mesh = init_device_mesh("cpu", (env.world_size,))
        for mod in model.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        train = af.make_train_step(model, loss_fn, opt(moments), **kw)

        def rows(t):
            return DTensor.from_local(my_rows(t, env.rank, env.world_size), mesh, [Shard(0)])
    else:
        train = af.make_train_step(model, loss_fn, opt(moments), group=env.group, **kw)

        def rows(t):
            return my_rows(t, env.rank, env.world_size)
    state = train.init()
    step_fn = train.step_ if inplace else train.step
    rec = _new_record()
    for step, (x, y) in enumerate(global_batches()):
        w = torch.tensor(float("inf") if step == INJECT_STEP and env.rank == 1 else 1.0)
        state, o = step_fn(state, rows(x), rows(y), w)
        _record(rec, list(state.params.items()), state, o.finite, state.loss_scale.loss_scale)
    return rec


PATHS = [(s, p, m) for s, moments in (("ddp", ("q8",)), ("fsdp2", ("q8", "bf16")))
         for m in moments for p in ("step", "step_", "make_train_step", "make_train_step.step_", "ModuleTrainer")]


def scenario_paths(env, out):
    table, errors = {}, {}
    for setting, path, moments in PATHS:
        try:
            if path in ("step", "step_"):
                table[(setting, path, moments)] = _pure_path(env, setting, path, moments)
            elif path == "ModuleTrainer":
                table[(setting, path, moments)] = _trainer_path(env, setting, moments)
            else:
                table[(setting, path, moments)] = _train_step_path(env, setting, path.endswith("step_"), moments)
        except Exception as e:  # noqa: BLE001 - recorded, so one failing cell names itself in its test
            import traceback
            errors[(setting, path, moments)] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
            dist.barrier()
    out.update(table=table, errors=errors, concatenated={m: reference(m) for m in ("q8", "bf16")})


def scenario_sharded_state(env, out):
    """FSDP2 with master="split" and q8 moments: the state per shard, the q8 rule per shard, a
    moment overflow in one rank's shard named on every rank, a checkpoint resumed bit for bit."""
    init_device_mesh, _, _, Shard, distribute_tensor = _dtensor_api()
    mesh = init_device_mesh("cpu", (env.world_size,))
    torch.manual_seed(3)
    # 'whole': 32 x 256 (8,192; shards of 4,096: q8 per shard); 'halves': 16 x 256 (4,096: q8 in one
    # process, but each 8-row shard has 2,048 < 4,096: fp32 moments); 'uneven': 33 x 256 (shards of
    # 17 and 16 rows: 4,352 and 4,096 elements, q8 on both)
    full = {"whole": torch.randn(32, 256), "halves": torch.randn(16, 256), "uneven": torch.randn(33, 256)}
    params = {k: distribute_tensor(v.bfloat16(), mesh, [Shard(0)]) for k, v in full.items()}
    tx = af.mixed_precision(opt("q8"), af.NoOpLossScale(), master="split")
    state = tx.init(params)
    codes = state.inner.exp_avg.codes
    out["layout"] = {k: (str(codes[k].dtype), tuple(codes[k].shape), tuple(state.inner.exp_avg.absmax[k].shape),
                         tuple(state.master.remainder[k].shape)) for k in full}
    out["one_process_q8"] = sorted(k for k, c in tx.init({k: v.bfloat16() for k, v in full.items()})
                                   .inner.exp_avg.codes.items() if c.dtype == torch.uint8)
    # a gradient of 1e21 in rank 1's shard of 'whole': (1 - b2) * g**2 overflows fp32
    g = torch.Generator().manual_seed(4)
    grads = {k: torch.randn(v.shape, generator=g) for k, v in full.items()}
    grads["whole"][20, 5] = 1e21  # row 20: rank 1's shard (rows 16-31)
    dgrads = {k: distribute_tensor(v.bfloat16(), mesh, [Shard(0)]) for k, v in grads.items()}
    _, state = tx.step_(params, dgrads, state)
    out["overflow_local"] = af.monitor.moment_overflows(state)
    out["overflow_group"] = af.monitor.moment_overflows(state, group=env.group)

    # a checkpoint of the sharded low-memory state (FSDP2 module, step_), an inf on rank 1 after it
    ckpt = os.path.join(os.environ["AMPFUNC_TEST_OUT"], "lowmem_ckpt")
    batches = global_batches()

    def train(model, tx, state, steps, first):
        params = dict(model.named_parameters())
        for step, (x, y) in enumerate(steps, first):
            x, y = my_rows(x, env.rank, env.world_size), my_rows(y, env.rank, env.world_size)
            af.scale_loss(F.cross_entropy(model(x).float(), y), af.loss_scale_of(state)).backward()
            if step == 4 and env.rank == 1:
                poison(model[0].weight.grad.to_local())
            with torch.no_grad():
                _, state = tx.step_(params, {k: p.grad for k, p in params.items()}, state)
            model.zero_grad(set_to_none=True)
        return state

    def make():
        model = shard(net())
        tx = af.mixed_precision(opt("q8"), loss_scale(), master="split")
        return model, tx, tx.init(dict(model.named_parameters()))

    model, tx, state = make()
    state = train(model, tx, state, batches[:3], 0)
    af.dist.save_sharded({"params": af.params_of(model), "state": state}, ckpt)
    state = train(model, tx, state, batches[3:], 3)
    resumed, tx2, fresh = make()
    loaded = af.dist.load_sharded(ckpt, like={"params": af.params_of(resumed), "state": fresh})
    af.functional.copy_to_module(resumed, loaded["params"])
    state2 = train(resumed, tx2, loaded["state"], batches[3:], 3)
    out.update(ckpt_params=[_local(p).clone() for p in model.parameters()],
               ckpt_params_resumed=[_local(p).clone() for p in resumed.parameters()],
               ckpt_state=_tensors(state), ckpt_state_resumed=_tensors(state2),
               ckpt_state_types=sorted({type(t).__name__ for t in af.tree.tree_leaves(state2)}),
               ckpt_q8=isinstance(state2.inner.exp_avg, af.lowmem.Q8Moment),
               ckpt_skipped=(int(state.skipped), int(state2.skipped)))


def main():
    scenario, outdir = sys.argv[1], sys.argv[2]
    os.environ["AMPFUNC_TEST_OUT"] = outdir
    env = af.dist.init_from_env()
    out = {"rank": env.rank, "world_size": env.world_size}
    try:
        {"paths": scenario_paths, "sharded_state": scenario_sharded_state}[scenario](env, out)
        torch.save(out, os.path.join(outdir, f"rank{env.rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
