"""ModuleTrainer in the user's loop on the CPU: backward makes new gradients every step.

step() frees them; the memory must stay with the process for the next backward instead of
being trimmed from the heap and faulted in again page by page (docs/design/real_loop_speed.md).
Counted with minor page faults (a count, not a timing), in a fresh process (a clean heap)."""

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import json, resource, torch, ampfunc as af
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(64)])  # 64 MB of fp32 params
trainer = af.ModuleTrainer(model, af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-3)),
                           loss_scale=af.DynamicLossScale())
params = list(model.parameters())
faults = []
for _ in range(5):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for p in params:  # what backward does: a new gradient tensor per param, written once
        p.grad = torch.empty_like(p).fill_(1e-3)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    trainer.step()
print(json.dumps({"faults": faults, "pages": sum(p.numel() * 4 for p in params) // 4096}))
"""


def _run(env_extra):
    env = dict(os.environ, **env_extra)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or "glibc" not in " ".join(os.confstr("CS_GNU_LIBC_VERSION")
                    .split()[:1]), reason="glibc's heap trimming")
def test_fresh_gradients_reuse_the_freed_memory():
    r = _run({"AMPFUNC_KEEP_HEAP": "1"})
    steady = r["faults"][2:]  # the first backwards map the memory once
    assert max(steady) < r["pages"] // 10, r
