"""Durable, all-or-nothing writes of one file or of a directory of files.

A checkpoint is worthless if a crash (or a full disk, or a kill) during its save can leave a
half-written file, or new weights next to an old config. Every file lora_func writes goes
to a temporary name next to its target, is flushed to the disk (``fsync``), and is renamed
into place; the directory that holds it is flushed after the rename, so the rename itself
survives a power cut. A checkpoint of several files (peft's pair, a training checkpoint)
is written as a whole new sibling directory that then takes the old one's place in one step:
``renameat2(RENAME_EXCHANGE)`` on Linux. The other entries of the old directory (a README,
tokenizer files) are carried over as hard links first. Where the exchange is not available
(another OS, an old kernel, a file system or a mount point that refuses it) the files are
renamed into the old directory one after the other: each file stays whole, the set is best
effort.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import Tensor

_AT_FDCWD = -100
_RENAME_EXCHANGE = 1 << 1


def fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk. Directories cannot be
    opened for that on Windows; there it is skipped (NTFS journals its metadata)."""
    if path.is_dir() and sys.platform.startswith("win"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, write: Callable[[Path], Any]) -> None:
    """``write(tmp)`` to a temporary file next to ``path``, flushed, then renamed to ``path``:
    ``path`` is the old file or the whole new one, never a part. On any failure the old file
    is untouched and the temporary one removed."""
    created = make_parents(path.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            write(Path(tmp))
            fsync(Path(tmp))
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except BaseException:
        remove_empty(created)
        raise
    fsync(path.parent)


def make_parents(directory: Path) -> list[Path]:
    """``directory.mkdir(parents=True, exist_ok=True)``, returning the directories it
    created, outermost first, so that a failed save can take them away again."""
    missing = []
    for parent in (directory, *directory.parents):
        if parent.exists():
            break
        missing.append(parent)
    directory.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def remove_empty(created: list[Path]) -> None:
    """Remove the directories a failed save created, innermost first, where still empty
    (another writer may have put something there meanwhile: then it stays)."""
    for directory in reversed(created):
        try:
            directory.rmdir()
        except OSError:
            return


def _renameat2() -> Any:
    """libc's ``renameat2``, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` in one atomic step; False (nothing changed) where
    the platform or the file system cannot."""
    function = _renameat2()
    return function is not None and function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry(src: Path, dst: Path) -> None:
    """``src`` (an entry of the old directory that the save does not write) at ``dst``."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _staging_directory(target: Path) -> Path:
    """A new empty directory next to ``target`` (mode as ``mkdir`` gives it, unlike mkdtemp's 0700)."""
    while True:
        staging = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
        try:
            staging.mkdir()
        except FileExistsError:
            continue
        return staging


def _working_directory() -> Path | None:
    try:
        return Path(os.getcwd())
    except OSError:  # deleted
        return None


def replace_directory(target: Path, files: Mapping[str, Callable[[Path], Any]]) -> None:
    """Make ``target`` a directory holding ``files`` (name -> ``write(path)``) and, if it
    existed, its other entries, in one atomic step where the platform allows (see above). A
    failure at any point leaves ``target`` as it was and no temporary entry next to it."""
    created = make_parents(target.parent)
    try:
        staging = _staging_directory(target)
    except BaseException:
        remove_empty(created)
        raise
    try:
        for name, write in files.items():
            write(staging / name)
            fsync(staging / name)
        if not target.exists():
            fsync(staging)
            try:
                os.rename(staging, target)
            except OSError as err:
                # Another writer made the first save of the same new directory between the
                # check and the rename: exchange with its directory, as for any existing one.
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not target.is_dir():
                    raise
            else:
                fsync(target.parent)
                return
        shutil.copymode(target, staging)
        for entry in sorted(target.iterdir()):
            if entry.name not in files:
                _carry(entry, staging / entry.name)
        fsync(staging)  # its entries: the new files and the links carried over
        cwd = _working_directory()
        if _exchange(staging, target):
            fsync(target.parent)
            if cwd is not None and (cwd == target or target in cwd.parents):
                os.chdir(cwd)  # the same path, now in the new directory (the old one is removed below)
        else:
            for name in files:  # best effort: each file atomically, one after the other
                os.replace(staging / name, target / name)
            fsync(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        remove_empty(created)
        raise
    finally:
        # The staging directory, or after the exchange the old checkpoint.
        shutil.rmtree(staging, ignore_errors=True)


def safetensors_write(path: Path, write: Callable[[], Any]) -> None:
    """``write()`` (a ``safetensors`` save to ``path``), with its I/O failures (a full disk, a
    vanished directory), which safetensors raises as ``SafetensorError``, re-raised as
    ``OSError``: callers' ``except OSError`` then sees them like any other failed write."""
    from safetensors import SafetensorError

    try:
        write()
    except SafetensorError as err:
        raise OSError(f"could not write {path}: {err}; free disk space or check the directory, then save again") from err  # error: file-write-failed


def read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """A safetensors file's tensors and metadata; ``ValueError`` naming the file when it cannot
    be read (truncated, corrupted, not safetensors)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupted?): {err}") from None  # error: load-unreadable
    return {key: _aligned(tensor) for key, tensor in tensors.items()}, metadata


# torch's CPU allocator aligns every allocation to 64 bytes
_ALIGNMENT = 64


def _aligned(tensor: Tensor) -> Tensor:
    """``tensor``, copied to torch-allocated memory where its data is not 64-byte aligned.

    safetensors hands tensors back at 8-byte-aligned addresses, and MKL's GEMM sums in another
    order on an operand that is not 64-byte aligned (float64 products one ulp apart, e.g. PEANuT's
    ``Wᵀ Aᵀ``): a loaded adapter would then not compute bit for bit what the saved one did."""
    return tensor if tensor.data_ptr() % _ALIGNMENT == 0 else tensor.clone()
