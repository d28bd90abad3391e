"""Checkpoints that notice damage: ``torch.save`` bytes behind a versioned, checksummed header.

``torch.save`` alone writes a zip archive whose tensor bytes ``torch.load`` reads back without
verifying them: a file with overwritten bytes in a tensor's storage loads, and the damage shows
up later as NaN or wrong numbers in the run. :func:`save` writes the same ``torch.save`` payload
after a fixed header (a magic line, a format version, the payload's length and its SHA-256), and
:func:`load` refuses, with :class:`CheckpointError`, a file whose header is missing, whose
version is newer than this library's, which is truncated, or whose bytes do not match the
checksum -- before anything is unpickled. A path is written atomically (a temporary file in the
same folder, flushed to disk, then renamed over the target), so a crash mid-save leaves the old
checkpoint intact.

Every ampfunc state (parameters, optimizer states, loss scales, :class:`MixedPrecisionState`, ...)
is a pytree of tensors and resumes bit for bit through this pair.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import tempfile
from typing import IO, Any, Union

import torch

__all__ = ["FORMAT_VERSION", "CheckpointError", "save", "load"]

#: The format this module writes. :func:`load` reads this version and older ones.
FORMAT_VERSION = 1

_MAGIC = b"AMPFUNC-CHECKPOINT\n"
# version (uint32), payload length (uint64), SHA-256 of (version, length, payload): little endian.
_FIELDS = struct.Struct("<IQ")
_HEADER_LEN = len(_MAGIC) + _FIELDS.size + hashlib.sha256().digest_size

PathOrFile = Union[str, "os.PathLike[str]", IO[bytes]]


class CheckpointError(ValueError):
    """A checkpoint file that is not one, is newer than this library, truncated or corrupted."""


def _digest(version: int, payload: bytes) -> bytes:
    h = hashlib.sha256(_FIELDS.pack(version, len(payload)))
    h.update(payload)
    return h.digest()


def _name(f: PathOrFile) -> str:
    return os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", type(f).__name__)


def save(obj: Any, f: PathOrFile) -> None:
    """Writes ``obj`` (anything ``torch.save`` takes) to ``f`` with a version and a checksum.

    Args:
      obj: the object to save, typically ``{"params": ..., "opt_state": ..., "step": ...}``.
      f: a path (written atomically: temporary file, fsync, rename) or a binary file object
        (written at its current position).

    Returns:
      None.

    Example:
      >>> af.checkpoint.save({"params": params, "state": state}, "ckpt.pt")  # doctest: +SKIP
      >>> ckpt = af.checkpoint.load("ckpt.pt")                               # doctest: +SKIP

    Cost: one ``torch.save`` into memory (host memory for one serialized copy of the state, on
    top of the state), one SHA-256 pass over the bytes (about 1 GB/s) and one write; tensors on
    a GPU are copied to the host (as ``torch.save`` does). The file gets ``torch.save``'s
    permissions (the umask's), or those of the file it replaces.
    """
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getbuffer()  # a view, not a copy: the bytes are held once
    header = _MAGIC + _FIELDS.pack(FORMAT_VERSION, len(payload)) + _digest(FORMAT_VERSION, payload)
    if not isinstance(f, (str, os.PathLike)):
        f.write(header)
        f.write(payload)
        return
    path = os.fspath(f)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".ampfunc-ckpt-", dir=folder)
    try:
        # mkstemp makes the file 0600: give it torch.save's mode (the umask's), or the mode of
        # the file it replaces, so other users and jobs can still read the checkpoints
        try:
            mode = os.stat(path).st_mode & 0o7777
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(header)
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _read_exact(fh: IO[bytes], n: int) -> bytes:
    """Up to ``n`` bytes from ``fh``: fewer only at the end of the stream (short reads are retried)."""
    chunks, left = [], n
    while left > 0:
        chunk = fh.read(min(left, 1 << 26))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_checkpoint(fh: IO[bytes], name: str, whole: bool) -> bytes:
    """The verified payload of the checkpoint at ``fh``'s position; ``fh`` is left right after it.
    ``whole``: ``fh`` is a file that must hold this checkpoint only (trailing bytes refused)."""
    header = _read_exact(fh, _HEADER_LEN)
    if not header:
        raise CheckpointError(f"{name!r}: no checkpoint there: " + ("the file is empty" if whole else
                              "the stream is at its end (every checkpoint in it was read)"))
    if not header.startswith(_MAGIC):
        raise CheckpointError(f"{name!r} is not an ampfunc checkpoint (no ampfunc header); a file from plain "
                              "torch.save is read with torch.load, which does not verify its bytes")
    if len(header) < _HEADER_LEN:
        raise CheckpointError(f"{name!r}: truncated ampfunc checkpoint ({len(header)} bytes, shorter than its "
                              "header)")
    version, length = _FIELDS.unpack_from(header, len(_MAGIC))
    if version > FORMAT_VERSION or version < 1:
        raise CheckpointError(f"{name!r}: checkpoint format version {version} is not supported (this ampfunc "
                              f"reads versions 1 to {FORMAT_VERSION}); upgrade ampfunc")
    digest = header[len(_MAGIC) + _FIELDS.size:]
    payload = _read_exact(fh, length)
    if len(payload) < length:
        raise CheckpointError(f"{name!r}: checkpoint truncated: the header records {length} payload bytes, "
                              f"the {'file' if whole else 'stream'} holds {len(payload)}")
    if whole:
        extra = len(fh.read())
        if extra:
            raise CheckpointError(f"{name!r}: checkpoint has extra bytes: the header records {length} payload "
                                  f"bytes, the file holds {length + extra}")
    if _digest(version, payload) != digest:
        raise CheckpointError(f"{name!r}: checkpoint corrupted: its bytes do not match the recorded SHA-256 "
                              "(the file was modified after it was written)")
    return payload


def load(f: PathOrFile, *, map_location=None, weights_only: bool = True) -> Any:
    """Reads what :func:`save` wrote, after checking its header, length and checksum.

    A path must hold one checkpoint and nothing else. From a binary file object exactly the
    checkpoint at its current position is read (the header records the payload's length) and
    the object is left positioned right after it, so checkpoints saved one after another into
    one stream are loaded one after another (``torch.load`` cannot: it leaves a stream at an
    unspecified position). When a file object's checkpoint is refused and the object is
    seekable, it is put back where it was.

    Args:
      f: a path or a binary file object positioned at the checkpoint.
      map_location: as for ``torch.load`` (e.g. ``"cpu"``).
      weights_only: as for ``torch.load``; True (the default) unpickles only tensors, containers
        and the ampfunc state classes.

    Returns:
      The saved object.

    Raises:
      CheckpointError: the file has no ampfunc header (a plain ``torch.save`` file: load it with
        ``torch.load``), was written by a newer format version, is truncated, has extra bytes
        (a path only), or its bytes do not match the recorded SHA-256. The message names the
        file.

    Example:
      >>> state = af.checkpoint.load("ckpt.pt", map_location="cpu")  # doctest: +SKIP
      >>> with open("run.ckpts", "rb") as fh:                        # doctest: +SKIP
      ...     first, second = af.checkpoint.load(fh), af.checkpoint.load(fh)

    Cost: one read of the checkpoint's bytes into host memory (the whole serialized state, held
    while ``torch.load`` rebuilds it) and one SHA-256 pass before ``torch.load``.
    """
    name = _name(f)
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as fh:
            payload = _read_checkpoint(fh, name, whole=True)
    else:
        try:
            start = f.tell() if f.seekable() else None
        except (AttributeError, OSError, ValueError):
            start = None
        try:
            payload = _read_checkpoint(f, name, whole=False)
        except CheckpointError:
            if start is not None:
                f.seek(start)
            raise
    return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=weights_only)
