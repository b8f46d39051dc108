"""``--host unix:///path``: the API on a unix domain socket, as candle-vllm's ``--h`` serves it.

1. ``unix_socket_path`` reads candle-vllm's three schemes (``unix://``, ``file://``,
   ``socket://``); ``check_unix_socket_path`` refuses, before anything is loaded, a path whose
   folder is missing, that holds something other than a socket (a user's file is never deleted)
   or that a live server listens on.
2. ``bind_unix_socket`` binds the path just before uvicorn runs, so a bind failure is one line
   before the engines warm up. A socket file left by a killed server (nothing accepts on it) is
   replaced; one a live server listens on is an error. The socket does not listen until uvicorn
   serves it, so clients are refused until the ready line, as on a TCP port. Its permissions are
   the process umask's (uvicorn's own ``uds=`` would make it 0o666, writable by every user).
3. ``UnixSocket.remove`` deletes the file on shutdown, unless another server has bound the path
   since.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass

SCHEMES = ("unix://", "file://", "socket://")


class UnixSocketError(RuntimeError):
    """The unix socket could not be bound."""


def unix_socket_path(host: str) -> str | None:
    """The absolute socket path of ``unix:///path`` (or ``file://``, ``socket://``); None for a
    TCP host. ValueError when no path follows the scheme."""
    for scheme in SCHEMES:
        if host.startswith(scheme):
            path = host[len(scheme) :]
            if not path:
                raise ValueError(f"--host {host}: expected {scheme}/path/to.sock")
            return os.path.abspath(path)
    return None


def check_unix_socket_path(path: str) -> None:
    """ValueError unless ``path`` can be served on: its folder exists and nothing but a socket
    is there already."""
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise ValueError(f"--host unix://{path}: the folder {folder} does not exist")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(
            f"--host unix://{path}: {path} exists and is not a socket; remove it or pick "
            "another path"
        )
    try:
        listening = _listening(path)
    except OSError as exc:
        raise ValueError(f"--host unix://{path}: {exc}") from None
    if listening:
        raise ValueError(f"--host unix://{path}: another server is listening on it")


@dataclass(frozen=True)
class UnixSocket:
    """A bound unix socket and the identity of its file, to remove only that file."""

    sock: socket.socket
    path: str
    device: int
    inode: int

    def remove(self) -> None:
        """Delete the socket file, unless it is gone or another server has bound the path since."""
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return
        if (info.st_dev, info.st_ino) == (self.device, self.inode):
            os.unlink(self.path)


def _listening(path: str) -> bool:
    """Whether a server accepts connections on the socket file at ``path`` (OSError when it
    cannot be told, e.g. no permission)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return False
    finally:
        probe.close()
    return True


def _remove_stale(path: str) -> None:
    """Delete the socket file at ``path`` if nothing accepts on it (a killed server's)."""
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise UnixSocketError(f"cannot serve on unix://{path}: it exists and is not a socket")
        listening = _listening(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UnixSocketError(f"cannot serve on unix://{path}: {exc}") from None
    if listening:
        raise UnixSocketError(f"cannot serve on unix://{path}: another server is listening on it")
    os.unlink(path)  # no listener: left by a server that did not shut down


def bind_unix_socket(path: str) -> UnixSocket:
    """Bind ``path`` (not listening yet); UnixSocketError says why it cannot be."""
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        why = "another server bound it just now" if exc.errno == errno.EADDRINUSE else exc
        raise UnixSocketError(f"cannot serve on unix://{path}: {why}") from None
    info = os.stat(path)
    return UnixSocket(sock, path, info.st_dev, info.st_ino)
