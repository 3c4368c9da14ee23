"""The disk cache of compiled kernels: a private directory whose entries are written atomically
and authenticated before anything in them is loaded.

The cache lives in `FULMEN_CACHE_DIR`, else `$XDG_CACHE_HOME/fulmen`, else `~/.cache/fulmen`.
An entry is a directory `<kind>/k_<key>/` (kind "cpp" for CPU kernels) holding the object, the
source it was compiled from, and `<object>.mac`.

NOTE [kernel cache trust]: loading a shared object runs its code in this process, so nothing is
loaded on the strength of its name. The cache directory must be owned by this user and writable
by nobody else (fulmen creates its directories with mode 0700). A directory that is not, or that
cannot be created or written, is not used: kernels go to a fresh private temporary directory for
the rest of the process, and one warning says so. `<object>.mac` is an HMAC-SHA256 of the entry's
key and the object's bytes under a per-user secret (`<root>/key`, 32 random bytes, mode 0600);
an object is handed to the loader only when its MAC verifies. A truncated, corrupt or planted
object is never opened by the loader: the entry is removed and rebuilt (one warning per
process). Processes of the same user are trusted (they could write the key as well).

NOTE [atomic entries]: an entry is built in a workspace `<kind>/.tmp-<host>-<pid>-<random>/`,
its files fsynced, and then renamed into place as a whole: readers see no entry or a complete
one, and of two processes building the same entry the first to rename wins. Workspaces left by
killed processes (a dead pid on this host, or older than an hour) are removed when a process
first uses the directory.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import hmac
import os
import secrets
import shutil
import socket
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from fulmen import config

KEY_BYTES = 32
STALE_SECONDS = 3600  # a workspace this old is abandoned (a compile times out after 300 s)
_WORKSPACE = ".tmp-"

_lock = threading.RLock()
_roots: dict[str, Path] = {}  # requested root -> the root in use (itself, or a private one)
_secrets: dict[Path, bytes] = {}
_swept: set[Path] = set()
_warned: set[str] = set()


class CacheError(OSError):
    """A cache directory cannot be used (the message says why)."""


def requested_root() -> Path:
    """The cache directory asked for: `FULMEN_CACHE_DIR`, else `$XDG_CACHE_HOME/fulmen`, else
    `~/.cache/fulmen` (nothing is checked or created).

    Example:
        >>> requested_root()
        PosixPath('/home/me/.cache/fulmen')
    """
    configured = config.get("FULMEN_CACHE_DIR")
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec: a relative path is invalid, ignore it
        return Path(xdg) / "fulmen"
    return Path.home() / ".cache" / "fulmen"


def root() -> Path:
    """The cache directory in use: `requested_root()` when it is private to this user (created
    with mode 0700 if missing), else a private temporary directory (one warning; NOTE [kernel
    cache trust])."""
    requested = requested_root()
    found = _roots.get(str(requested))
    if found is not None:
        return found
    with _lock:
        found = _roots.get(str(requested))
        if found is None:
            try:
                _ensure_private_dir(requested)
                _secret(requested)
                found = requested
            except OSError as error:
                found = _private_root(requested, error)
            _roots[str(requested)] = found
    return found


def kind_dir(kind: str) -> Path:
    """The directory of one kind of entry (`root() / kind`), checked like the root; workspaces
    that killed processes left in it are removed on its first use in this process."""
    path = root() / kind
    if path in _swept:
        return path
    with _lock:
        try:
            _ensure_private_dir(path)
        except OSError as error:
            if not give_up(error):
                raise
            path = root() / kind
            _ensure_private_dir(path)
        _sweep(path)
        _swept.add(path)
    return path


def entry_path(kind: str, key: str, name: str) -> Path:
    """Where the object `name` of entry `key` lives (whether or not it exists)."""
    return kind_dir(kind) / f"k_{key}" / name


def lookup(kind: str, key: str, name: str) -> Path | None:
    """The object `name` of entry `key` if the entry exists and its MAC verifies, else None.
    An entry that fails verification is removed (one warning per process)."""
    path = entry_path(kind, key, name)
    if not path.parent.exists():
        return None
    if _verify(key, path):
        return path
    _warn_once("verify", f"fulmen kernel cache: {path} failed verification (truncated, corrupt "
               "or not written by fulmen); it is not loaded and is rebuilt (this warning shows "
               "once per process)")
    with contextlib.suppress(OSError):
        _discard(path.parent)
    return None


@contextlib.contextmanager
def workspace(kind: str) -> Iterator[Path]:
    """A fresh private directory to build an entry in (see `publish`); removed on exit unless
    it was published."""
    prefix = f"{_WORKSPACE}{_host_tag()}-{os.getpid()}-"
    try:
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=kind_dir(kind)))
    except FileNotFoundError:  # the cache was deleted while in use: set it up again
        _forget()
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=kind_dir(kind)))
    try:
        yield path
    finally:
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)


def publish(kind: str, key: str, built: Path, name: str) -> Path:
    """Make the workspace `built` (holding the object `name`) the entry `key`: MAC, fsync,
    atomic rename (NOTE [atomic entries]); returns the entry's object. When another process
    published the same entry first, its (verified) object is returned."""
    obj = built / name
    (built / f"{name}.mac").write_text(_mac(key, obj.read_bytes()))
    for path in built.iterdir():
        os.chmod(path, 0o600)
        _fsync(path)
    _fsync(built)
    entry = entry_path(kind, key, name).parent
    for _ in range(2):
        try:
            os.rename(built, entry)
            _fsync(entry.parent)
            return entry / name
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        if _verify(key, entry / name):
            return entry / name
        _discard(entry)
    raise CacheError(f"could not publish {entry}")


def contains(kind: str, key: str, name: str) -> bool:
    """Whether entry `key` has its object `name` on disk (not verified: see `lookup`)."""
    return entry_path(kind, key, name).exists()


def give_up(error: OSError) -> bool:
    """The requested root failed while in use (`error`): use a private temporary root from now
    on (one warning). False when a private root is already in use (nothing left to try)."""
    requested = requested_root()
    with _lock:
        if _roots.get(str(requested)) != requested:
            return False
        _roots[str(requested)] = _private_root(requested, error)
        return True


def _forget() -> None:
    """Check and set up the requested root again at its next use."""
    with _lock:
        found = _roots.pop(str(requested_root()), None)
        if found is not None:
            _secrets.pop(found, None)
            _swept.difference_update([p for p in _swept if p.parent == found])


def _ensure_private_dir(path: Path) -> None:
    """Create `path` (mode 0700) if missing; raise CacheError unless it is a directory owned by
    this user, writable by it and by nobody else."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise CacheError(f"{path} is not a directory")
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        raise CacheError(f"{path} is owned by another user (uid {info.st_uid})")
    if info.st_mode & 0o022:
        raise CacheError(f"{path} is writable by group or others "
                         f"(mode {stat.S_IMODE(info.st_mode):o}; chmod 700 it to use it)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise CacheError(f"{path} is not writable")


def _secret(root_dir: Path) -> bytes:
    """The MAC key of `root_dir` (its file `key`, created with mode 0600 when missing)."""
    found = _secrets.get(root_dir)
    if found is not None:
        return found
    path = root_dir / "key"
    if not path.exists():
        _create_key(path)
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or info.st_mode & 0o077 or info.st_size != KEY_BYTES \
            or (hasattr(os, "geteuid") and info.st_uid != os.geteuid()):
        raise CacheError(f"{path} is not a private key file of this user (mode 0600, "
                         f"{KEY_BYTES} bytes)")
    _secrets[root_dir] = path.read_bytes()
    return _secrets[root_dir]


def _create_key(path: Path) -> None:
    """Write a new random key to `path` atomically; a key another process wrote first stays."""
    fd, tmp = tempfile.mkstemp(prefix=_WORKSPACE, dir=path.parent)  # mode 0600
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)
        os.close(fd)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        os.unlink(tmp)


def _mac(key: str, data: bytes) -> str:
    secret = _secret(root())
    return hmac.new(secret, key.encode() + b"\0" + data, hashlib.sha256).hexdigest()


def _verify(key: str, obj: Path) -> bool:
    """Whether `obj` is a regular file whose bytes match its `.mac` (NOTE [kernel cache
    trust])."""
    try:
        if not stat.S_ISREG(os.lstat(obj).st_mode):
            return False
        expected = obj.with_name(obj.name + ".mac").read_text().strip()
        return hmac.compare_digest(expected, _mac(key, obj.read_bytes()))
    except (OSError, UnicodeDecodeError):
        return False


def _discard(entry: Path) -> None:
    """Remove an entry: renamed aside first, so no reader sees it half deleted."""
    aside = entry.with_name(f"{_WORKSPACE}{_host_tag()}-{os.getpid()}-discard-{entry.name}")
    try:
        os.rename(entry, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _sweep(directory: Path) -> None:
    """Remove the workspaces of processes that died while building (NOTE [atomic entries])."""
    now = time.time()
    for path in directory.glob(f"{_WORKSPACE}*"):
        with contextlib.suppress(OSError):
            if _abandoned(path.name) or now - path.lstat().st_mtime > STALE_SECONDS:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink()


def _abandoned(name: str) -> bool:
    """Whether the workspace called `name` belongs to a process of this host that is gone."""
    parts = name[len(_WORKSPACE):].split("-")
    if len(parts) < 2 or parts[0] != _host_tag() or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _fsync(path: Path) -> None:
    """Flush a file's or directory's data to disk (directories: where the OS allows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories
    finally:
        os.close(fd)


def _private_root(requested: Path, error: OSError) -> Path:
    """A fresh temporary cache directory for this process (removed at exit), with a warning."""
    try:
        path = Path(tempfile.mkdtemp(prefix="fulmen-kernels-"))
    except OSError as tmp_error:
        raise CacheError(f"no usable kernel cache: {error}; and no temporary directory: "
                         f"{tmp_error}") from error
    _secret(path)
    atexit.register(_remove_private_root, path, os.getpid())
    _warn_once(f"root:{requested}", f"fulmen kernel cache: not using {requested}: {error}; "
               f"kernels are cached in {path} for this process only")
    return path


def _remove_private_root(path: Path, owner: int) -> None:
    if os.getpid() == owner:  # a forked child exiting leaves its parent's directory alone
        shutil.rmtree(path, ignore_errors=True)


def _warn_once(topic: str, message: str) -> None:
    if topic not in _warned:
        _warned.add(topic)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):  # POSIX only (no fork on Windows)
    os.register_at_fork(after_in_child=_after_fork_in_child)
