"""The disk tier's files and keys (``EngineConfig.kv_disk_path``): plain Python, no torch.

A page's key is SHA-256 chained over its prefix's token ids, from a root salted with the
*fingerprint* of everything that changes KV values (the weights, dtype, quantization, KV
cache dtype, page size, cache layout, forward path: ``acb.worker.disk_pages.fingerprint``)
and the LoRA adapter: a different model, dtype or adapter reaches other keys. Python's
``hash()`` (the in-memory prefix cache's) is 64-bit and per build; files outlive builds.

One file per page, ``<key hex>.kvp``: a header (magic, version, fingerprint, key, the page's
in-memory chain hash, payload length, payload CRC-32, header CRC-32) then the page's bytes.
Written to a temporary file named after the writing process, fsynced, then renamed over
its name (atomic on POSIX): a process killed mid-write leaves only a temporary file, which
is never read and is deleted once its writer is gone. Every read checks the header and the
CRC; a file that fails is never served (``CorruptPage``).
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
import threading
import zlib
from array import array
from collections.abc import Iterator, Sequence

MAGIC = b"ACBKVPG\0"
VERSION = 1
SUFFIX = ".kvp"
_HEADER = struct.Struct("<8sI32s32sqQII")  # magic, version, fingerprint, key, chain hash, length, crc, header crc
HEADER_SIZE = _HEADER.size
# errors that mean the directory takes no more writes (read-only, full, no permission)
UNWRITABLE = frozenset({errno.EROFS, errno.ENOSPC, errno.EACCES, errno.EPERM, getattr(errno, "EDQUOT", errno.ENOSPC)})


class CorruptPage(Exception):
    """A page file that must not be served: truncated, foreign or damaged (the reason)."""


def disk_root(fingerprint: bytes, lora_id: int | None) -> bytes:
    """The parent key of a chain's first page under ``fingerprint`` and the LoRA adapter
    ``lora_id`` (None: the base model)."""
    adapter = b"" if lora_id is None else str(lora_id).encode()
    return hashlib.sha256(b"acb-kv-root\0" + fingerprint + b"\0" + adapter).digest()


def disk_keys(root: bytes, token_ids: Sequence[int], page_size: int, num_pages: int) -> list[bytes]:
    """The keys of the first ``num_pages`` full pages of ``token_ids``, each SHA-256 of its
    parent's key and its tokens (signed 64-bit little-endian)."""
    return list(iter_disk_keys(root, token_ids, page_size, num_pages))


def iter_disk_keys(root: bytes, token_ids: Sequence[int], page_size: int, num_pages: int) -> Iterator[bytes]:
    """``disk_keys`` one at a time (a lookup stops at its first miss)."""
    parent = root
    sha = hashlib.sha256
    for i in range(num_pages):
        parent = sha(parent + array("q", token_ids[i * page_size : (i + 1) * page_size]).tobytes()).digest()
        yield parent


def page_path(directory: str, key: bytes) -> str:
    return os.path.join(directory, key.hex() + SUFFIX)


def write_page(directory: str, key: bytes, fingerprint: bytes, chain: int, payload) -> int:
    """Write one page file crash-safely (temporary file, fsync, rename); its size in bytes.
    OSError on failure (the temporary file removed)."""
    view = memoryview(payload).cast("B")
    header = _HEADER.pack(MAGIC, VERSION, fingerprint, key, chain, len(view), zlib.crc32(view), 0)
    header = header[:-4] + struct.pack("<I", zlib.crc32(header[:-4]))
    tmp = os.path.join(directory, f".{key.hex()}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(view)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, page_path(directory, key))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return HEADER_SIZE + len(view)


def read_page(path: str, fingerprint: bytes, key: bytes, length: int) -> bytearray:
    """The payload of the page file at ``path``, checked to be ``key``'s page of ``length``
    bytes under ``fingerprint``; ``CorruptPage`` naming what is wrong otherwise (a file
    that is gone raises FileNotFoundError)."""
    with open(path, "rb") as f:
        head = f.read(HEADER_SIZE)
        if len(head) < HEADER_SIZE:
            raise CorruptPage("truncated header")
        magic, version, fp, k, _chain, n, crc, head_crc = _HEADER.unpack(head)
        if magic != MAGIC or version != VERSION:
            raise CorruptPage("not an acb page file of this version")
        if zlib.crc32(head[:-4]) != head_crc:
            raise CorruptPage("header checksum mismatch")
        if fp != fingerprint or k != key:
            raise CorruptPage("foreign page (another model, dtype, layout or key)")
        if n != length:
            raise CorruptPage(f"payload of {n} bytes, expected {length}")
        payload = bytearray(n)
        got = f.readinto(payload)
        if got != n or f.read(1):
            raise CorruptPage("truncated or overlong payload")
    if zlib.crc32(payload) != crc:
        raise CorruptPage("payload checksum mismatch")
    return payload


def read_chain_hash(path: str) -> int | None:
    """The in-memory chain hash a page file's header records (None if unreadable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
        return _HEADER.unpack(head)[4] if len(head) == HEADER_SIZE else None
    except (OSError, struct.error):
        return None


def scan(directory: str) -> Iterator[tuple[bytes, int, float]]:
    """(key, size, mtime) of each page file in ``directory``, in no order."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if not name.endswith(SUFFIX) or len(name) != 64 + len(SUFFIX):
            continue
        try:
            key = bytes.fromhex(name[:64])
            st = entry.stat()
        except (ValueError, OSError):
            continue
        yield key, st.st_size, st.st_mtime


def remove_stale_temporaries(directory: str) -> int:
    """Delete temporary files whose writing process is gone (killed mid-write); how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not (name.startswith(".") and name.endswith(".tmp")):
            continue
        parts = name.split(".")
        try:
            pid = int(parts[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and _alive(pid):
            continue  # another engine on this directory is writing it
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_directory(path: str) -> str | None:
    """Why ``path`` cannot hold the disk tier (created if missing), or None: it must be a
    directory this process can create, write, rename and delete files in."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot be created ({e.strerror})"
    if not os.path.isdir(path):
        return "is not a directory"
    probe = os.path.join(path, f".probe.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(probe, "wb") as f:
            f.write(b"acb")
        os.replace(probe, probe + "2")
        os.unlink(probe + "2")
    except OSError as e:
        for name in (probe, probe + "2"):
            try:
                os.unlink(name)
            except OSError:
                pass
        return f"is not writable ({e.strerror})"
    return None
