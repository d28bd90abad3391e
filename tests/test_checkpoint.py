"""ampfunc.checkpoint: a save/load pair that refuses damaged, truncated, foreign and future files."""

import io
import os
import stat

import pytest
import torch

import ampfunc as af
from _helpers import bits
from ampfunc.checkpoint import FORMAT_VERSION, CheckpointError


def _state():
    torch.manual_seed(0)
    params = {"w": torch.randn(64, 32, dtype=torch.float16), "b": torch.randn(32, dtype=torch.float16)}
    tx = af.mixed_precision(af.adamw(1e-3), loss_scale=af.DynamicLossScale(2.0**8, growth_interval=3))
    state = tx.init(params)
    for i in range(4):
        grads = {k: torch.randn_like(v) * (float("inf") if i == 1 else 1.0) for k, v in params.items()}
        params, state = tx.step(params, grads, state)
    return tx, params, state


def _tree_bits(tree):
    return [(t.dtype, t.shape, bits(t).clone()) for t in af.tree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _assert_same(a, b):
    assert af.tree.tree_structure(a) == af.tree.tree_structure(b)
    for (da, sa, ba), (db, sb, bb) in zip(_tree_bits(a), _tree_bits(b)):
        assert da == db and sa == sb and torch.equal(ba, bb)


def test_roundtrip_resumes_bit_for_bit(tmp_path):
    tx, params, state = _state()
    path = tmp_path / "ckpt.pt"
    af.checkpoint.save({"params": params, "state": state}, path)
    back = af.checkpoint.load(path)
    _assert_same(back["params"], params)
    _assert_same(back["state"], state)
    # Resuming from the loaded copy gives the same next step as continuing the original.
    grads = {k: torch.full_like(v, 0.25) for k, v in params.items()}
    p1, s1 = tx.step(params, grads, state)
    p2, s2 = tx.step(back["params"], grads, back["state"])
    _assert_same((p1, s1), (p2, s2))
    assert not [n for n in os.listdir(tmp_path) if n != "ckpt.pt"]  # no temporary file left behind


def test_file_object_roundtrip():
    _, params, state = _state()
    buf = io.BytesIO()
    af.checkpoint.save(state, buf)
    buf.seek(0)
    _assert_same(af.checkpoint.load(buf), state)


def _payload_offset_of(blob: bytes, tensor: torch.Tensor) -> int:
    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    at = blob.find(raw)
    assert at > 0
    return at


def test_plain_torch_save_loads_overwritten_bytes_silently(tmp_path):
    # What torch.save alone gives (the README says so): damage inside a tensor's bytes loads.
    t = torch.arange(256, dtype=torch.float32)
    path = tmp_path / "plain.pt"
    torch.save({"t": t}, path)
    blob = bytearray(path.read_bytes())
    at = _payload_offset_of(bytes(blob), t)
    blob[at + 40:at + 44] = b"\xff\xff\xff\x7f"  # a NaN over element 10
    path.write_bytes(bytes(blob))
    back = torch.load(path)["t"]
    assert torch.isnan(back[10]) and not torch.equal(back, t)


def test_overwritten_bytes_are_refused(tmp_path):
    t = torch.arange(256, dtype=torch.float32)
    path = tmp_path / "ckpt.pt"
    af.checkpoint.save({"t": t}, path)
    blob = bytearray(path.read_bytes())
    at = _payload_offset_of(bytes(blob), t)
    blob[at + 40:at + 44] = b"\xff\xff\xff\x7f"
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="corrupted.*SHA-256") as err:
        af.checkpoint.load(path)
    assert "ckpt.pt" in str(err.value)


@pytest.mark.parametrize("cut", [1, 100, 10_000])
def test_truncated_file_is_refused(tmp_path, cut):
    path = tmp_path / "ckpt.pt"
    af.checkpoint.save({"t": torch.randn(4096)}, path)
    blob = path.read_bytes()
    path.write_bytes(blob[:-cut])
    with pytest.raises(CheckpointError, match="truncated"):
        af.checkpoint.load(path)


def test_extra_bytes_are_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    af.checkpoint.save({"t": torch.randn(8)}, path)
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(CheckpointError, match="extra bytes"):
        af.checkpoint.load(path)


def test_plain_torch_file_is_refused_with_a_hint(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"t": torch.randn(8)}, path)
    with pytest.raises(CheckpointError, match="not an ampfunc checkpoint.*torch.load"):
        af.checkpoint.load(path)


def test_newer_format_version_is_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    af.checkpoint.save({"t": torch.randn(8)}, path)
    blob = bytearray(path.read_bytes())
    at = len(b"AMPFUNC-CHECKPOINT\n")
    assert int.from_bytes(blob[at:at + 4], "little") == FORMAT_VERSION
    blob[at:at + 4] = (FORMAT_VERSION + 1).to_bytes(4, "little")
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=f"version {FORMAT_VERSION + 1}"):
        af.checkpoint.load(path)


def test_header_damage_is_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    af.checkpoint.save({"t": torch.randn(8)}, path)
    blob = bytearray(path.read_bytes())
    blob[len(b"AMPFUNC-CHECKPOINT\n") + 20] ^= 0x01  # one bit of the recorded digest
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="corrupted"):
        af.checkpoint.load(path)


def test_failed_save_keeps_the_old_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    af.checkpoint.save({"t": torch.ones(3)}, path)
    before = path.read_bytes()

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        af.checkpoint.save({"t": Unpicklable()}, path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


@pytest.mark.parametrize("method", ["step", "step_"])
def test_resume_after_a_skipped_step_and_mid_accumulation_is_bit_exact(tmp_path, method):
    torch.manual_seed(1)
    params = {"enc": {"w": torch.randn(6, 4, dtype=torch.float16)}, "head": {"b": torch.randn(4, dtype=torch.float16)}}
    tx = af.mixed_precision(af.accumulate(af.adamw(1e-2), 3), loss_scale=af.DynamicLossScale(2.0**8, growth_interval=2))
    state = tx.init(params)

    def grads(i):
        g = torch.Generator().manual_seed(i)
        out = {"enc": {"w": torch.randn(6, 4, generator=g)}, "head": {"b": torch.randn(4, generator=g)}}
        if i in (1, 6):
            out["head"]["b"][2] = float("inf")
        return af.tree.tree_cast(out, torch.float16)

    for i in range(3):  # finite, skipped, finite: two good mini-steps of three accumulated
        params, state = getattr(tx, method)(params, grads(i), state)
    path = tmp_path / "mid.pt"
    af.checkpoint.save({"params": params, "state": state}, path)
    back = af.checkpoint.load(path)
    a = (af.tree.tree_clone(params), af.tree.tree_clone(state))
    b = (back["params"], back["state"])
    for i in range(3, 9):
        a = getattr(tx, method)(a[0], grads(i), a[1])
        b = getattr(tx, method)(b[0], grads(i), b[1])
    _assert_same(a, b)


def test_save_gives_the_file_torch_saves_permissions_or_those_of_the_file_it_replaces(tmp_path):
    umask = os.umask(0o022)
    try:
        theirs, ours = tmp_path / "torch.pt", tmp_path / "ours.pt"
        torch.save({"w": torch.ones(2)}, theirs)
        af.checkpoint.save({"w": torch.ones(2)}, ours)
        assert stat.S_IMODE(os.stat(ours).st_mode) == stat.S_IMODE(os.stat(theirs).st_mode) == 0o644
        os.chmod(ours, 0o640)
        af.checkpoint.save({"w": torch.zeros(2)}, ours)  # replacing keeps the file's mode
        assert stat.S_IMODE(os.stat(ours).st_mode) == 0o640
    finally:
        os.umask(umask)
