"""Probe: ModuleTrainer(flat=True) with nn.Embedding(sparse=True): a COO gradient, as a real loop makes it."""
import torch
import ampfunc as af
for flat in (False, True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 2))
    tr = af.ModuleTrainer(model, af.adamw(1e-3), loss_scale=af.DynamicLossScale(256.0), flat=flat)
    tr.scale(model(torch.tensor([[1, 2], [3, 4]])).sum()).backward()
    before = [q.detach().clone() for q in model.parameters()]
    try:
        tr.step(); res = "NOT REFUSED"
    except Exception as e:
        res = f"{type(e).__name__}: {str(e)[:160]}"
    print(f"flat={flat}: params untouched={all(torch.equal(a, b) for a, b in zip(model.parameters(), before))} | {res}")

# What did flat=True do with the sparse gradient? Compare to the same model with a dense Embedding gradient.
def run(sparse_emb, flat):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=sparse_emb), torch.nn.Linear(3, 2))
    tr = af.ModuleTrainer(model, af.sgd(1.0), loss_scale=af.NoOpLossScale(), flat=flat)
    w0 = model[0].weight.detach().clone()
    tr.scale(model(torch.tensor([[1, 2], [3, 4]])).sum()).backward()
    tr.step()
    return w0, model[0].weight.detach().clone()
w0, ref = run(False, False)
_, got = run(True, True)
print("dense-grad reference moved rows:", sorted(set(torch.nonzero(ref != w0)[:, 0].tolist())))
print("flat=True sparse-grad moved rows:", sorted(set(torch.nonzero(got != w0)[:, 0].tolist())))
print("flat=True sparse result equals dense reference:", torch.equal(ref, got), "max diff", (ref - got).abs().max().item())
