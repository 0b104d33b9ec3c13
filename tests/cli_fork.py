"""Run `python -m parity.cli ARGS` for a test without paying for a fresh interpreter each time.

A CLI command in a fresh interpreter spends 2.5-3 s of CPU importing torch before it reads its
arguments; the suite runs about seventy of them (docs/measurements.md, ninth session). Here one
server process per pytest worker does what the CLI's first lines do (pin the CPU kernels, then
import torch and the stack) and forks a child per command. The child is a process of its own, as a
subprocess would be: its own environment, working directory, stdout and stderr (files, read back
as text), exit code, and the ranks it forks itself; only the interpreter start and the imports are
shared.

A command falls back to a real subprocess where a fresh interpreter is what the test is about
(``fresh=True``: what gets imported, when torch loads) or where the environment it asks for could
not take effect in a forked child (variables read by native libraries when they load or by parity
at import, see :func:`_needs_fresh_interpreter`).
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback

PARITY = [sys.executable, "-m", "parity.cli"]

ENV_AT_IMPORT = dict(os.environ)
"""The test process's environment at collection, before any fixture ran: a fixture that changes an
early variable of it (below) sends every later command to a fresh interpreter, whenever the server
started before it."""

_EARLY_PREFIXES = ("ATEN_", "MKL_", "OMP_", "KMP_", "GOMP_", "OPENBLAS_", "ONEDNN_", "DNNL_", "LD_",
                   "PYTHON", "TORCH", "CUDA", "CUBLAS", "NCCL_", "GLOO_", "TRITON", "NVTE_",
                   "PARITY_TRITON", "MASTER_", "RANK", "LOCAL_", "WORLD_", "GROUP_", "ROLE_")
"""Variables read when a native library loads, when parity's modules import, or by torch.distributed:
a command that sets them differently from the server gets a fresh interpreter."""


_HONOURED = {"PYTHONUNBUFFERED", "TORCHINDUCTOR_CACHE_DIR"}
"""Early variables the forked child applies itself. TORCHINDUCTOR_CACHE_DIR is read only when
inductor compiles, which parity never does; torch sets it in a test process whose test loads
inductor (torch's own AdamW, the op profiler), and counted as early it sent every later command
of that xdist worker to a fresh interpreter."""


def _needs_fresh_interpreter(env: dict[str, str], server_env: dict[str, str]) -> bool:
    """Whether ``env`` sets an early variable otherwise than the environment the server started in."""
    changed = (env.keys() ^ server_env.keys()) | {k for k in env.keys() & server_env.keys() if env[k] != server_env[k]}
    return any(k.startswith(_EARLY_PREFIXES) for k in changed - _HONOURED)


# ------------------------------------------------------------------------------------------------
# the server (a fresh interpreter: python tests/cli_fork.py SOCKET)
# ------------------------------------------------------------------------------------------------

def _serve(path: str) -> None:
    from parity.distributed.pins import pin_before_torch

    started_with = dict(os.environ)  # what a request's environment is compared with
    pin_before_torch()  # what parity.cli.main does first, before torch loads
    from parity.harness.forkserver import preload

    cli = importlib.import_module("parity.cli")
    cli.import_torch_uncollected()  # as the command does: torch imported uncollected, then frozen
    # the launcher and the whole stack, and the checkpoint code: a command that saves or loads
    # imports it before it forks its ranks, and many of the suite's commands do
    for module in preload(checkpoints=True):
        importlib.import_module(module)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    print(json.dumps(started_with), flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            req = json.loads(_Lines(conn).next())
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                _child(req)  # never returns
            conn.sendall(f"{pid}\n".encode())
            _, status = os.waitpid(pid, 0)
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())


def _child(req: dict) -> None:
    code = 1
    try:
        os.setsid()  # a group of its own: a timeout kills the command and the ranks it forked
        if req["cpus"] is not None:  # before anything runs: the ranks it forks inherit it
            os.sched_setaffinity(0, req["cpus"])
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        from parity.distributed.pins import LOAD_ENV

        # pin_before_torch's effect on the environment, which a fresh CLI would have (its ranks read it)
        for name, value in LOAD_ENV.items():
            os.environ.setdefault(name, value)
        for fd, name in ((0, os.devnull), (1, req["stdout"]), (2, req["stderr"])):
            f = os.open(name, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = open(0, closefd=False)
        sys.stdout = _text_stream(1, unbuffered, errors="strict", line_buffering=False)
        sys.stderr = _text_stream(2, unbuffered, errors="backslashreplace", line_buffering=True)
        sys.argv = ["parity"] + req["args"]
        atexit._clear()  # the server's handlers are not this command's
        from parity.cli import main

        code = main(req["args"])
    except SystemExit as e:  # as the interpreter maps it
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _text_stream(fd: int, unbuffered: bool, errors: str, line_buffering: bool) -> io.TextIOWrapper:
    """sys.stdout / sys.stderr as a fresh interpreter opens them on a file (PYTHONUNBUFFERED honoured)."""
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), errors=errors,
                            line_buffering=line_buffering, write_through=unbuffered)


class _Lines:
    """The lines a socket brings, one at a time. One recv may hold more than one: a command that
    exits at once has its pid and its exit code sent back to back."""

    def __init__(self, conn: socket.socket):
        self.conn, self.buf = conn, b""

    def next(self) -> bytes:
        while b"\n" not in self.buf:
            chunk = self.conn.recv(65536)  # a timeout here leaves what was read in buf
            if not chunk:
                raise ConnectionError("cli_fork: the other end closed")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line


# ------------------------------------------------------------------------------------------------
# the client (in the test process)
# ------------------------------------------------------------------------------------------------

class _Server:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="parity-cli-fork-")
        self.path = os.path.join(self.dir, "sock")
        env = dict(os.environ)
        # the server's imports are not a command's: a command asking for import times runs fresh
        env.pop("PYTHONPROFILEIMPORTTIME", None)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path],
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.env = json.loads(self.proc.stdout.readline())
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self):
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_server: _Server | None = None


def _get_server() -> _Server:
    global _server
    if _server is None or not _server.alive():
        _server = _Server()
    return _server


def run(args, *, env=None, timeout=300, cwd=None, fresh=False, cpus=None) -> subprocess.CompletedProcess:
    """`python -m parity.cli ARGS` as subprocess.run(capture_output=True, text=True) would run it;
    raises subprocess.TimeoutExpired the same way. ``cpus``: the CPUs the command may run on (Linux
    affinity, set in the command's process before it starts)."""
    args = [str(a) for a in args]
    env = dict(os.environ) if env is None else dict(env)
    cpus = None if cpus is None else sorted(cpus)
    server = None if fresh else _get_server()
    if server is None or _needs_fresh_interpreter(env, server.env):
        bind = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        return subprocess.run(PARITY + args, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd,
                              preexec_fn=bind)
    with tempfile.TemporaryDirectory(prefix="parity-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for name in (out, err):
            open(name, "wb").close()
        req = {"args": args, "env": env, "cwd": os.path.abspath(cwd or os.getcwd()), "stdout": out, "stderr": err,
               "cpus": cpus}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(server.path)
            conn.sendall((json.dumps(req) + "\n").encode())
            lines = _Lines(conn)
            pid = int(lines.next())
            conn.settimeout(timeout)
            try:
                code = int(lines.next())
            except socket.timeout:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                conn.settimeout(None)
                lines.next()
                raise subprocess.TimeoutExpired(PARITY + args, timeout, _read(out), _read(err)) from None
        return subprocess.CompletedProcess(PARITY + args, code, _read(out), _read(err))


def run_fresh_noting_torch(args, *, env, timeout=120) -> subprocess.CompletedProcess:
    """`parity ARGS` through ``parity.cli.main`` in a fresh interpreter that then prints whether torch
    was loaded ("torch loaded" / "no torch"), and exits with the command's code."""
    code = ("import sys; from parity.cli import main; rc = main(sys.argv[1:]); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *[str(a) for a in args]], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _read(name: str) -> str:
    with open(name, encoding="utf-8", errors="replace") as f:
        return f.read()


if __name__ == "__main__":
    _serve(sys.argv[1])
