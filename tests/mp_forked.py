"""The tests' side of ``mp_zygote``: ``start(*args)`` runs ``mismatch-probe ARGS`` forked from the
suite's pre-imported server and returns a handle like ``subprocess.Popen``'s (``poll``, ``wait``,
``kill``); ``wait`` gives a ``subprocess.CompletedProcess`` with the output as text. A call given
``env`` (variables that may be read at import) starts a fresh interpreter; so does every call where
the server cannot start, on a CUDA machine, or with ``MP_TESTS_FRESH=1``: each is a fresh ``python -m mismatch_probe``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ZYGOTE = Path(__file__).with_name("mp_zygote.py")


class _Server:
    """One pre-imported server per test process, started at the first call."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import runpy; runpy.run_path({str(ZYGOTE)!r}, run_name='__main__')"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO,
            # os.environ, not the C environment (pytest's may differ), and no terminal size: a console
            # made at import reads its width then; each call's own environment gives it
            env={k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
        )
        self.done: dict[int, int] = {}
        self.buf = b""
        first = self._message(timeout=600)
        if not first or not first.get("ready"):
            self.proc.kill()
            raise RuntimeError(f"the pre-imported server did not start: {first}")
        atexit.register(self.close)

    def _message(self, timeout: float) -> dict | None:
        out = self.proc.stdout
        assert out is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = max(0.0, deadline - time.monotonic())
            if not select.select([out], [], [], left)[0]:
                return None
            chunk = os.read(out.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError("the pre-imported server has gone")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def fork(self, args: list[str], env: dict[str, str], out: str, err: str) -> int:
        assert self.proc.stdin is not None
        req = {"args": args, "cwd": str(REPO), "env": env, "out": out, "err": err}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        while True:
            msg = self._message(timeout=60)
            if msg is None:
                raise RuntimeError("the pre-imported server did not fork")
            if "rc" in msg:
                self.done[msg["pid"]] = msg["rc"]
            else:
                return int(msg["pid"])

    def returncode(self, pid: int, timeout: float) -> int | None:
        """The child's exit status, waiting at most ``timeout`` seconds for it (None: still running)."""
        deadline = time.monotonic() + timeout
        while pid not in self.done:
            msg = self._message(timeout=max(0.0, deadline - time.monotonic()))
            if msg is None:
                return None
            self.done[msg["pid"]] = msg["rc"]
        return self.done[pid]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_server: _Server | None = None
_failed = False


def get_server() -> _Server | None:
    """The suite's server, started at the first call; None where calls start fresh interpreters."""
    global _server, _failed
    # a CUDA machine keeps fresh interpreters: the server's imports may touch the driver, and CUDA
    # does not survive a fork
    cuda = os.path.exists("/dev/nvidiactl")
    if _server is None and not _failed and not cuda and os.environ.get("MP_TESTS_FRESH") != "1":
        try:
            _server = _Server()
        except RuntimeError as e:
            print(f"mp_forked: {e}; every CLI call starts a fresh interpreter", file=sys.stderr)
            _failed = True
    return _server


class Forked:
    """A running ``mismatch-probe`` call (forked, or a fresh interpreter when there is no server)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.args = args
        self.returncode: int | None = None
        full = {**os.environ, "COLUMNS": "200", **(env or {})}  # Rich wraps tables to the terminal width
        server = get_server() if env is None else None
        self.server = server
        if server is None:
            self.popen: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-m", "mismatch_probe", *args], cwd=REPO, env=full, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
            return
        self.popen = None
        self.tmp = tempfile.TemporaryDirectory(prefix="mp-call-")
        self.out, self.err = f"{self.tmp.name}/out", f"{self.tmp.name}/err"
        self.pid = server.fork(args, full, self.out, self.err)

    def poll(self) -> int | None:
        if self.popen is not None:
            self.returncode = self.popen.poll()
        elif self.returncode is None:
            assert self.server is not None
            self.returncode = self.server.returncode(self.pid, 0)
        return self.returncode

    def kill(self) -> None:
        if self.popen is not None:
            self.popen.kill()
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        """Wait for the end (``subprocess.TimeoutExpired`` after ``timeout`` s, the call's tree
        killed, as ``subprocess.run`` does) and return what it printed."""
        cmd = [sys.executable, "-m", "mismatch_probe", *self.args]
        if self.popen is not None:
            try:
                out, err = self.popen.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.communicate()
                raise
            self.returncode = self.popen.returncode
            return subprocess.CompletedProcess(cmd, self.popen.returncode, out, err)
        assert self.server is not None
        rc = self.server.returncode(self.pid, 1e9 if timeout is None else timeout)
        if rc is None:
            self.kill()
            self.server.returncode(self.pid, 60)
            raise subprocess.TimeoutExpired(cmd, timeout or 0)
        self.returncode = rc
        out, err = Path(self.out).read_text(errors="replace"), Path(self.err).read_text(errors="replace")
        self.tmp.cleanup()
        return subprocess.CompletedProcess(cmd, rc, out, err)


def start(*args: str, env: dict[str, str] | None = None) -> Forked:
    """Start ``mismatch-probe ARGS`` in the repository's folder, with the suite's environment (``env``
    added: then in a fresh interpreter)."""
    return Forked([str(a) for a in args], env)
