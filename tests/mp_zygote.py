"""A pre-imported interpreter that forks one child per ``mismatch-probe`` call of the tests.

Every CLI call of the suite used to start a fresh interpreter and import torch, vLLM, transformers
and pyarrow again (~10 s of a ~17 s tiny ``compare`` on 2 cores). This server imports them once, in
a process that runs nothing else (no torch op, so no OpenMP pool; the native threads of the imports
are OpenBLAS's and jemalloc's, which both handle a fork), then forks a child per call that runs
``python -m mismatch_probe ARGS`` as the interpreter would (``runpy`` with ``alter_sys``: the same
``__main__``, so worker processes started with "spawn" re-import the same module), in the caller's
folder and environment, with its output in files. The engines start in the child exactly as in a
fresh process: nothing of them was started in the server.

Tests that are about a fresh interpreter (imports at start-up, the entry points, environment
variables read at import, faults injected through ``PYTHONPATH``) keep ``subprocess``.

Protocol (JSON lines): the client writes ``{"args", "cwd", "env", "out", "err"}``; the server
answers ``{"pid"}`` at once and ``{"pid", "rc"}`` when the child has ended (rc < 0: killed by that
signal, as ``subprocess`` reports it). Requests may overlap.
"""

from __future__ import annotations

import json
import os
import select
import sys

PRELOAD = (
    "numpy", "pyarrow", "pyarrow.parquet", "pyarrow.compute", "pandas", "rich", "typer", "torch",
    "transformers", "transformers.models.auto.tokenization_auto", "transformers.models.auto.modeling_auto",
    "vllm", "vllm.config", "vllm.engine.arg_utils", "vllm.entrypoints.llm", "vllm.v1.worker.cpu_model_runner",
    "mismatch_probe.cli.main", "mismatch_probe.steps.compare_stages",
)


def _child(req: dict) -> None:
    """Runs in the forked child: become ``python -m mismatch_probe ARGS``; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: the client stops the call's whole tree on a timeout
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        fd_in = os.open(os.devnull, os.O_RDONLY)
        fd_out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        fd_err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd, target in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        sys.argv = ["mismatch_probe", *req["args"]]
        sys.path[0] = req["cwd"]  # ``-m`` puts the folder it was started in first
        import runpy

        try:
            runpy.run_module("mismatch_probe", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        # what the interpreter does at exit: atexit handlers (vLLM's, the writers'), then flush
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _send(msg: dict) -> None:
    sys.__stdout__.write(json.dumps(msg) + "\n")
    sys.__stdout__.flush()


def _reap(children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            _send({"pid": pid, "rc": rc})


def serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    # No torch op has run here, so torch has no OpenMP pool yet. The native threads these imports do
    # start are OpenBLAS pools (numpy's, OpenCV's: shut down before a fork and started again in the
    # child, by OpenBLAS's own fork handlers) and pyarrow's jemalloc thread (fork-safe likewise).
    _send({"ready": True})
    children: set[int] = set()
    buf = b""
    stdin = sys.stdin.buffer.raw  # unbuffered: select() sees what is not read yet
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        if ready:
            chunk = os.read(stdin.fileno(), 1 << 16)
            if not chunk:
                break  # the client has gone: stop (children run on, as subprocesses would)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(req)
                children.add(pid)
                _send({"pid": pid})
        _reap(children)


if __name__ == "__main__":
    serve()
