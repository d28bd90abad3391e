"""Probe: ModuleTrainer(flat=True) with a hand-assigned sparse COO .grad (e.g. a user's own sparse
gradient, or a hook replacing it): which leaf is at fault is not named."""
import torch
import ampfunc as af
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(3, 4))
tr = af.ModuleTrainer(model, af.adamw(1e-3), loss_scale=af.NoOpLossScale(), flat=True)
for q in model.parameters():
    q.grad = torch.ones_like(q)      # fresh gradient tensors, as a user's loop may hand over
model[1].weight.grad = torch.ones(4, 3).to_sparse()
before = [q.detach().clone() for q in model.parameters()]
try:
    tr.step()
    print("NOT REFUSED")
except Exception as e:
    print(f"{type(e).__name__}: {str(e)[:200]}")
print("params untouched:", all(torch.equal(a, b) for a, b in zip(model.parameters(), before)))
