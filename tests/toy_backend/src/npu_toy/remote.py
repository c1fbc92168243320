"""The toy device server and its client: tensors behind a small op server on 127.0.0.1.

Server: ``TORCH_DEVICE_BACKEND_AUTOLOAD=0 python -m npu_toy.remote --port 0 --port-file F [--stall-file S]
[--kill-file K] [--max-s 1800]`` (autoload off: the package would load itself while importing torch):
one thread and one `Executor` (its buffers) per client connection; the chosen port is written to F.
While the file S exists it answers nothing (a hung device); once K exists it dies (a lost device);
it exits on SIGTERM/SIGINT, or after ``--max-s`` seconds whatever happens, so a test cannot leave it
behind.

Client: `Client` (``TOY_SERVER=127.0.0.1:PORT``, ``TOY_TIMEOUT`` seconds per call, 10 by default)
raises what a real client raises when the device side is gone: ConnectionRefusedError (no server),
BrokenPipeError / ConnectionResetError (it died), TimeoutError (it stopped answering); with a reconnect
window (``TOY_RECONNECT_S``) it keeps trying to connect that long and then raises
``ConnectionError("... could not reach the server again ...")`` from the refusal. It reconnects on
the next call, so a server that comes back serves again; buffers made by the one that died are gone
(their next use says ``toy device lost``). The wire format is length-prefixed pickle: a test double on
the loopback interface only.
"""

from __future__ import annotations

import argparse
import builtins
import os
import pickle
import signal
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

from npu_toy.device import Executor

_HEADER = struct.Struct("!Q")
_MAX_MESSAGE = 1 << 31


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionResetError("toy device server closed the connection")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv(sock: socket.socket) -> Any:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > _MAX_MESSAGE:
        raise ConnectionResetError(f"toy device server: message of {n} bytes refused")
    return pickle.loads(_recv_exact(sock, n))


class Client:
    """Executor calls over one connection per process."""

    def __init__(self, address: str, timeout_s: float, reconnect_s: float = 0.0) -> None:
        host, _, port = address.rpartition(":")
        self.address = (host or "127.0.0.1", int(port))
        self.timeout_s = timeout_s
        self.reconnect_s = reconnect_s
        self.sock: socket.socket | None = None
        self.pid = 0
        self.frees: list[int] = []  # handles whose tensors died: sent with the next call

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None

    def call(self, method: str, *args: Any) -> Any:
        if self.sock is None or self.pid != os.getpid():  # a forked child needs its own connection
            self.sock = None
            self.sock = self._connect()
            self.pid = os.getpid()
        frees, self.frees = self.frees, []
        try:
            _send(self.sock, (method, args, frees))
            ok, value = _recv(self.sock)
        except OSError:  # refused, reset, broken pipe, timed out: the caller sees it as it is
            self.close()
            raise
        if not ok:
            kind, message = value
            exc_type = getattr(builtins, kind, None)
            if not (isinstance(exc_type, type) and issubclass(exc_type, Exception)):
                raise RuntimeError(f"{kind}: {message}")
            raise exc_type(message)
        return value

    def _connect(self) -> socket.socket:
        """A connection; within the reconnect window a refused one is tried again (a server restarting),
        after it the client gives up in its own words, the refusal as the cause."""
        deadline = time.monotonic() + self.reconnect_s
        while True:
            try:
                return socket.create_connection(self.address, timeout=self.timeout_s)
            except OSError as e:
                if self.reconnect_s <= 0:
                    raise
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"toy client: could not reach the server again at {self.address[0]}:"
                                          f"{self.address[1]} within {self.reconnect_s:g} s") from e
                time.sleep(0.2)

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args: self.call(method, *args)


def _serve_client(conn: socket.socket, stall_file: str | None, stop: threading.Event) -> None:
    executor = Executor()
    conn.settimeout(1.0)
    with conn:
        while not stop.is_set():
            try:
                method, args, frees = _recv(conn)
            except TimeoutError:
                continue
            except (OSError, EOFError, pickle.UnpicklingError):
                return  # the client went away: its buffers go with it
            while stall_file and os.path.exists(stall_file) and not stop.is_set():
                time.sleep(0.05)  # a hung device: it never answers while the file is there
            executor.free(frees)
            try:
                reply = (True, getattr(executor, method)(*args))
            except Exception as e:
                reply = (False, (type(e).__name__, str(e)))
            try:
                _send(conn, reply)
            except OSError:
                return


def serve(port: int, port_file: str | None = None, stall_file: str | None = None, max_s: float = 1800.0,
          kill_file: str | None = None) -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with socket.create_server(("127.0.0.1", port)) as srv:
        srv.settimeout(0.2)
        if port_file:
            tmp = Path(port_file + ".tmp")
            tmp.write_text(str(srv.getsockname()[1]))
            tmp.replace(port_file)
        deadline = time.monotonic() + max_s
        while not stop.is_set() and time.monotonic() < deadline:
            if kill_file and os.path.exists(kill_file):
                os._exit(1)  # dies on the spot: clients see their connections reset
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_serve_client, args=(conn, stall_file, stop), daemon=True).start()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m npu_toy.remote", description="the toy device server")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file")
    p.add_argument("--stall-file", help="while this file exists, the device answers nothing")
    p.add_argument("--kill-file", help="once this file exists, the device dies")
    p.add_argument("--max-s", type=float, default=1800.0, help="exit after this long, whatever happens")
    a = p.parse_args()
    serve(a.port, a.port_file, a.stall_file, a.max_s, a.kill_file)


if __name__ == "__main__":
    main()
