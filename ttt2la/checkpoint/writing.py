"""Writing a checkpoint directory atomically: everything goes into a temporary directory beside
the destination, which is renamed into place only once complete. An error or an interruption
(Ctrl-C) removes the temporary directory, so no partial output is ever left behind."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from pathlib import Path

from .errors import CheckpointError


def check_output_dir(out: Path, *, force: bool = False, inputs=(), name: str = "--out") -> Path:
    """Refuse an output path that exists (unless ``force``), that is or contains an input, or
    whose folder cannot be written — before any work is done. ``name``: the argument as the
    caller knows it (``--out`` on the command line, ``directory`` in ``ttt2la.save``)."""
    out = Path(out)
    force_hint = "--force" if name.startswith("--") else "force=True"
    target = out.resolve()
    for given in inputs:
        src = Path(given).resolve()
        if target == src or target in src.parents:
            raise CheckpointError(f"{name} {out}: is the input {given}{' or holds it' * (target != src)}; "
                                  "choose another output directory")
        if src in target.parents:
            raise CheckpointError(f"{name} {out}: lies inside the input {given}, which writing "
                                  "it would change; choose an output directory outside it")
    here = Path.cwd().resolve()
    if target == here or target in here.parents:
        raise CheckpointError(f"{name} {out}: is the current directory"
                              f"{' or holds it' * (target != here)}, which cannot be replaced; "
                              "choose a new output directory")
    if out.exists() and not force:
        raise CheckpointError(f"{name} {out}: already exists; choose a new path or pass "
                              f"{force_hint} to replace it")
    parent = target.parent
    if not parent.is_dir():
        raise CheckpointError(f"{name} {out}: the folder {parent} does not exist")
    try:
        probe = tempfile.mkdtemp(dir=parent, prefix=f".{out.name}.", suffix=".probe")
        os.rmdir(probe)
    except OSError as e:
        raise CheckpointError(f"{name} {out}: cannot write in {parent} ({e.strerror or e})") \
            from e
    return out


def check_output_file(path, *, name: str, inputs=(), out=None, others=()) -> Path:
    """Refuse an output file (``--json``, ``--plot``; ``name`` says which) that is an input or
    lies in one (a checkpoint directory, its config, its example inputs), that is or lies in
    the ``out`` directory written beside it, that is another output (``others``: ``(name,
    path)`` pairs), or that cannot be written — before any work is done, so nothing is
    overwritten and nothing half-done is thrown away."""
    from ..validation import check_writable

    path = Path(path)
    clashes = [(f"the input {given}", given) for given in inputs]
    clashes += [(f"the --out directory {out}", out)] if out else []
    clashes += [(f"{other_name} {other}", other) for other_name, other in others if other]
    for what, other in clashes:
        relation = _overlap(path, Path(other))
        if relation:
            raise CheckpointError(f"{name} {path}: {relation} {what}, which writing it would "
                                  f"overwrite; choose another path for {name}")
    check_writable(path, name)
    return path


def _overlap(path: Path, other: Path) -> str:
    """How ``path`` clashes with ``other``: ``"is"`` (the same file, by name or by link),
    ``"lies inside"`` (a file in that directory), or ``""``."""
    target, resolved = path.resolve(), other.resolve()
    if target == resolved:
        return "is"
    if resolved in target.parents:
        return "lies inside"
    try:
        return "is" if path.exists() and other.exists() and os.path.samefile(path, other) else ""
    except OSError:
        return ""


@contextlib.contextmanager
def atomic_file(path):
    """Yield a temporary path beside ``path`` (ending as it does, so a writer that reads the
    format from the suffix still can); on success rename it to ``path``, on any error or
    interruption delete it. A file that cannot be written raises a ``CheckpointError``."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.",
                                   suffix=f".partial{path.suffix}")
        os.close(fd)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write in {path.resolve().parent} "
                              f"({e.strerror or e})") from e
    tmp = Path(tmp)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())      # as a plain write would, not mkstemp's 0600
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"{path}: cannot write ({e.strerror or e})") from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_directory(out: Path, *, force: bool = False):
    """Yield a fresh temporary directory beside ``out``; on success rename it to ``out``
    (replacing ``out`` only with ``force``), on any error or interruption delete it."""
    out = Path(out)
    try:
        tmp = Path(tempfile.mkdtemp(dir=out.resolve().parent, prefix=f".{out.name}.",
                                    suffix=".partial"))
    except OSError as e:
        raise CheckpointError(f"{out}: cannot write in {out.resolve().parent} "
                              f"({e.strerror or e})") from e
    try:
        yield tmp
        _plain_modes(tmp)
        _replace(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _plain_modes(directory: Path) -> None:
    """Give ``directory`` and what it holds the modes a plain ``mkdir`` and ``open`` give under
    the umask, not the owner-only ones of ``mkdtemp`` (and of writers such as safetensors'), so
    a checkpoint written to a shared folder is as readable as any other file there."""
    mask = _umask()
    for root, dirs, files in os.walk(directory):
        for name in files:
            file = os.path.join(root, name)
            if not os.path.islink(file):
                os.chmod(file, 0o666 & ~mask)
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o777 & ~mask)
    os.chmod(directory, 0o777 & ~mask)


def _umask() -> int:
    """The process's umask (read by setting it and putting it back: there is no other way)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _replace(tmp: Path, out: Path, force: bool) -> None:
    if not os.path.lexists(out):
        os.rename(tmp, out)
        return
    if not force:
        raise CheckpointError(f"{out}: appeared while writing; nothing was replaced")
    old = Path(tempfile.mkdtemp(dir=tmp.parent, prefix=f".{out.name}.", suffix=".old"))
    os.rmdir(old)
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()


__all__ = ["check_output_dir", "check_output_file", "atomic_file", "atomic_directory"]
