"""Two processes over gloo on CPU, launched as torchrun would (RANK/WORLD_SIZE/MASTER_* env).

In every run an inf is injected into the gradients of rank 1 only, at one step. The
specification: every rank skips that step, the loss scales stay equal on every rank, DDP params
stay identical across ranks, and the distributed run equals a single-process run of the same
global batch; under FSDP2 the clipping norm is the global (single-process) norm and sharded
state saves and resumes exactly. The workers live in ``_dist_worker.py``.
"""

import os
import socket
import subprocess
import sys

import pytest
import torch

import ampfunc as af

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _dist_worker import INJECT_STEP, STEPS  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
slow = pytest.mark.slow  # spawns two processes

WORLD = 2
EXPECTED_FINITE = [step != INJECT_STEP for step in range(STEPS)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, outdir, worker: str = "_dist_worker.py") -> list[dict]:
    """Runs ``scenario`` of ``worker`` on WORLD local processes and returns what each rank recorded."""
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                   OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   AMPFUNC_TEST_IMPORT_ROOT=os.path.dirname(os.path.dirname(os.path.abspath(af.__file__))))
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, worker), scenario, str(outdir)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=90)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} of {scenario!r} exited with {p.returncode}:\n{log[-3000:]}"
    return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return launch("ddp", tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    return launch("fsdp2", tmp_path_factory.mktemp("fsdp2"))


# ----------------------------------------------------------------------------------------------
# DDP
# ----------------------------------------------------------------------------------------------


@slow
def test_ddp_every_rank_skips_the_step_where_one_rank_saw_an_inf(ddp):
    for out in ddp:
        assert out["finite"] == EXPECTED_FINITE, out["rank"]


@slow
def test_ddp_loss_scales_stay_equal_on_every_rank_and_to_the_single_process_run(ddp):
    assert ddp[0]["scales"] == ddp[1]["scales"] == ddp[0]["reference"]["scales"]
    assert ddp[0]["scales"][INJECT_STEP] < ddp[0]["scales"][INJECT_STEP - 1]  # backed off


@slow
def test_ddp_params_are_identical_across_ranks_and_equal_the_single_process_run(ddp):
    ref = ddp[0]["reference"]
    for k, p in ddp[0]["params"].items():
        assert torch.equal(p, ddp[1]["params"][k]), k
        assert torch.allclose(p, ref["params"][k], rtol=1e-5, atol=1e-6), k


@slow
def test_value_and_grad_with_a_group_averages_grads_and_agrees_on_finite(ddp):
    for out in ddp:
        # Rank 1's loss is inf in the second call; rank 0's is clean, yet both skip.
        assert out["functional_finite"] == (True, False), out["rank"]
        for k, g in out["functional_grads"].items():
            assert torch.allclose(g, out["functional_full_grads"][k], rtol=1e-5, atol=1e-7), k
    for k in ddp[0]["functional_grads"]:
        assert torch.equal(ddp[0]["functional_grads"][k], ddp[1]["functional_grads"][k])


def test_all_reduce_mean_divides_before_it_sums_so_fp16_gradients_do_not_overflow(ddp):
    # 40000 + 40000 is inf in fp16; DDP's default hook divides first and so does all_reduce_mean.
    for out in ddp:
        assert out["fp16_mean"].dtype == torch.float16 and out["fp16_mean"].tolist() == [40000.0] * 4


@slow
def test_make_train_step_with_a_group_equals_one_process_on_the_global_batch(ddp):
    ref_params, ref_finite, ref_scale = ddp[0]["train_step_reference"]
    assert ref_finite == EXPECTED_FINITE
    for out in ddp:
        params, finite, scale = out["train_step"]
        assert finite == EXPECTED_FINITE, out["rank"]  # only rank 1's loss was inf
        assert scale == ref_scale
    for k, p in ddp[0]["train_step"][0].items():
        assert torch.equal(p, ddp[1]["train_step"][0][k]), k
        assert torch.allclose(p, ref_params[k], rtol=1e-5, atol=1e-6), k


# ----------------------------------------------------------------------------------------------
# FSDP2 (fully_shard: DTensor params and grads)
# ----------------------------------------------------------------------------------------------


@slow
def test_fsdp2_grads_are_dtensor_shards(fsdp2):
    assert fsdp2[0]["grad_placements"] == ["(Shard(dim=0),)"]


@slow
def test_fsdp2_ranks_disagree_locally_but_every_rank_skips(fsdp2):
    # Without the flag all-reduce, rank 0 would have applied the step that rank 1 skipped.
    assert [out["local_finite_at_inject"] for out in fsdp2] == [True, False]
    for out in fsdp2:
        assert out["finite"] == EXPECTED_FINITE, out["rank"]
    assert fsdp2[0]["scales"] == fsdp2[1]["scales"] == fsdp2[0]["reference"]["scales"]


@slow
def test_fsdp2_clipping_norm_is_the_single_process_global_norm(fsdp2):
    ref_norm = fsdp2[0]["reference"]["norm"]
    for out in fsdp2:
        assert torch.allclose(out["dtensor_grad_norm"], ref_norm, rtol=1e-5), out["rank"]
        assert torch.allclose(out["local_shard_grad_norm"], ref_norm, rtol=1e-5), out["rank"]
    assert float(ref_norm) > 0.05 * 2.0**10  # the clip (0.05, on unscaled grads) was active


@slow
def test_fsdp2_params_equal_the_single_process_run_with_global_clipping(fsdp2):
    ref = fsdp2[0]["reference"]["params"]
    for k, p in fsdp2[0]["params"].items():
        assert torch.equal(p, fsdp2[1]["params"][k]), k
        assert torch.allclose(p, ref[k], rtol=1e-5, atol=1e-6), k


@slow
def test_global_norm_of_distribute_tensor_leaves_counts_each_whole_tensor_once(fsdp2):
    for out in fsdp2:
        assert torch.allclose(out["manual_dtensor_norm"], out["manual_full_norm"], rtol=1e-6)
        assert "Partial" in out["partial_error"] and "'p'" in out["partial_error"]


@slow
def test_sharded_state_saves_per_rank_and_resumes_bit_for_bit(tmp_path):
    outs = launch("checkpoint", tmp_path)
    assert outs[0]["files"] == ["shard-00000-of-00002.pt", "shard-00001-of-00002.pt"]
    for out in outs:
        assert out["scales"][0] == out["scales"][1]
        for k, p in out["uninterrupted"].items():
            assert torch.equal(out["resumed"][k], p), (out["rank"], k)
        # mixed_precision on DTensor params: the state is per rank, plain tensors of the local
        # shards (16 rows over 2 ranks: 8), and it resumes bit for bit (an inf on rank 1 after
        # the resume skipped on both ranks, in both runs)
        assert out["state_leaf_types"] == ["Tensor"] and out["exp_avg_local_shape"] == (8, 6)
        assert out["mp_skipped"] == (1, 1)
        for k, p in out["mp_uninterrupted"].items():
            assert torch.equal(out["mp_resumed"][k], p), (out["rank"], k)
        for a, b in zip(out["mp_state"], out["mp_state_resumed"]):
            assert torch.equal(a, b)


@slow
def test_misuse_across_ranks_is_refused_by_name_on_every_rank(tmp_path):
    outs = launch("misuse", tmp_path)
    for out in outs:
        # ranks holding leaves of other shapes: refused, naming the leaf and both ranks
        assert "trees differ at leaf 'a'" in out["layout_error"] and "rank 0" in out["layout_error"] \
            and "rank 1" in out["layout_error"], out["layout_error"]
        assert torch.equal(out["mean"], torch.full((3,), 1.5))
        # a NaN amax on rank 1 reaches rank 0 (as +inf: neither is recorded)
        assert torch.isinf(out["fp8_amax"]), out["fp8_amax"]
        assert torch.isinf(out["fp8_amax_inf"]), out["fp8_amax_inf"]
    # rank 1 is not in the group of rank 0 alone: refused (it used to divide by -1, negating the
    # gradients); rank 0 averages over itself
    assert outs[0]["nonmember_error"] is None and outs[0]["nonmember_flag_error"] is None
    assert "not a member of the group" in outs[1]["nonmember_error"]
    assert "not a member of the group" in outs[1]["nonmember_flag_error"]


# ----------------------------------------------------------------------------------------------
# Every path x (DDP, FSDP2 with DTensor params, FSDP2's local shards), one spawn for all
# ----------------------------------------------------------------------------------------------

PATHS = [(s, p) for s in ("ddp", "fsdp2", "local") for p in ("update", "step", "step_", "ModuleTrainer")] + \
    [(s, p) for s in ("ddp", "fsdp2") for p in ("make_train_step", "make_train_step.step_")]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return launch("paths", tmp_path_factory.mktemp("paths"))


@slow
@pytest.mark.parametrize("setting,path", PATHS, ids=[f"{s}-{p}" for s, p in PATHS])
def test_every_path_equals_one_process_of_torch_on_the_whole_batch(paths, setting, path):
    # torch.optim.AdamW + clip_grad_norm_ on the concatenated batch, the injected step skipped;
    # the clip is active, so a norm taken over one rank's shards only would differ.
    ref = paths[0]["reference"]
    for out in paths:
        rec = out["table"][(setting, path)]
        for step in range(len(ref)):
            for k, want in ref[step].items():
                got = rec["params"][step][k]
                assert (got - want).abs().max() <= 1e-5, (out["rank"], step, k)


@slow
@pytest.mark.parametrize("setting,path", PATHS, ids=[f"{s}-{p}" for s, p in PATHS])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(paths, setting, path):
    a, b = (out["table"][(setting, path)] for out in paths)
    assert a["finite"] == b["finite"] == EXPECTED_FINITE
    assert a["scale"] == b["scale"] and a["scale"][INJECT_STEP] < a["scale"][INJECT_STEP - 1]
    # nothing written at the skipped step, and the ranks hold the same params after every step
    for k in a["params"][INJECT_STEP]:
        assert torch.equal(a["params"][INJECT_STEP][k], a["params"][INJECT_STEP - 1][k]), k
    for pa, pb in zip(a["params"], b["params"]):
        assert all(torch.equal(pa[k], pb[k]) for k in pa)


@slow
def test_dtensor_params_run_the_fused_kernels_on_their_local_shards(paths):
    for out in paths:
        for (setting, path), calls in out["kernel_calls"].items():
            if setting == "local":  # clip_by_global_norm(group=) is not kernel-backed: generic path
                assert calls == 0, (setting, path)
            else:
                assert calls == len(EXPECTED_FINITE), (setting, path, calls)


@slow
def test_bad_sharded_input_is_refused_naming_the_leaf(paths):
    for out in paths:
        err = out["refusals"]
        assert "params leaf 'b' is a plain tensor but leaf 'a' is a DTensor" in err["mixed_init"]
        assert "params leaf 'b' is a plain tensor" in err["mixed_step_"]
        assert "grads leaf 'a' is a plain tensor but its param is a DTensor" in err["plain_grad"]
        assert "grads leaf 'b' is a DTensor but the params are plain tensors" in err["dtensor_grad_plain_param"]
        assert "params leaf 'c' is a DTensor on mesh" in err["two_meshes"] and "leaf 'a'" in err["two_meshes"]
        assert "ModuleTrainer: params leaf 'extra' is a plain tensor" in err["trainer_mixed"]
        assert "make_train_step" in err["fsdp2_module"] and "fully_shard" in err["fsdp2_module"]
        assert "params leaf 'p'" in err["partial"] and "Partial" in err["partial"]
        assert err["untouched"]


@slow
def test_leaves_sharded_and_replicated_in_one_step_count_each_whole_tensor_once(paths):
    for out in paths:  # fused and generic clip, against the single-process clip of the full tensors
        assert max(out["refusals"]["mixed_layout_diffs"]) <= 1e-6, out["refusals"]["mixed_layout_diffs"]
        err = out["refusals"]
        assert abs(float(err["global_norm_group_in_step"]) - float(err["global_norm_want"])) <= 1e-5
        # a clip group that does not span the mesh: named, before any write
        assert f"clip_by_global_norm: group spans ranks [{out['rank']}] but the DTensor params lie on a mesh of " \
            "ranks [0, 1]" in err["clip_group_conflict"], err["clip_group_conflict"]
        assert err["clip_group_conflict_untouched"]


@slow
def test_a_moment_overflow_in_one_ranks_shard_is_named_on_every_rank(paths):
    assert [out["moment_alerts"]["local_only"] for out in paths] == [[], ["w"]]  # what group= is for
    for out in paths:
        alerts = out["moment_alerts"]
        assert alerts["with_group"] == ["w"], out["rank"]
        assert alerts["health_with_group"] == "unhealthy", out["rank"]
        assert len(alerts["stats_health_with_group"]) == 1 and "'w'" in alerts["stats_health_with_group"][0]
        assert alerts["dtensor"] == ["w"], out["rank"]  # DTensor moments: over their mesh, no group needed


# ----------------------------------------------------------------------------------------------
# Single process: the helpers behave without a process group
# ----------------------------------------------------------------------------------------------


def test_init_from_env_without_world_size_runs_as_a_single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    env = af.dist.init_from_env()
    assert (env.rank, env.world_size, env.group) == (0, 1, None)
    assert not torch.distributed.is_initialized()


def test_load_sharded_refuses_a_tree_of_another_shape(tmp_path):
    tree = {"w": torch.ones(3), "ls": af.DynamicLossScale(8.0)}
    af.dist.save_sharded(tree, str(tmp_path))
    loaded = af.dist.load_sharded(str(tmp_path), like={"w": torch.zeros(3), "ls": af.DynamicLossScale()})
    assert torch.equal(loaded["w"], torch.ones(3)) and float(loaded["ls"].loss_scale) == 8.0
    with pytest.raises(ValueError, match="'w'"):
        af.dist.load_sharded(str(tmp_path), like={"w": torch.zeros(4), "ls": af.DynamicLossScale()})
    with pytest.raises(ValueError, match="v"):
        af.dist.load_sharded(str(tmp_path), like={"v": torch.zeros(3), "ls": af.DynamicLossScale()})


def test_sharded_clip_without_a_group_is_clip_grad_norm():
    grads = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}
    clipped, _ = af.clip_by_global_norm(1.0, group=None).update(grads, af.transform.EmptyState())
    assert torch.allclose(clipped["a"], torch.tensor([0.6, 0.0])) and torch.allclose(clipped["b"], torch.tensor([0.8]))
    with pytest.raises(ValueError, match="max_norm"):
        af.clip_by_global_norm(0.0, group=None)
