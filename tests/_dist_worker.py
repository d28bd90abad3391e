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
         "misuse": scenario_misuse}[scenario](env, out)
        torch.save(out, os.path.join(outdir, f"rank{env.rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
