"""Warm starts for the tests' `lmforge` and `torchrun` processes: a fork server (a helper module, not a test file).

Of a brief `lmforge train` (10 tiny steps) on this 2-core machine, about half the CPU time is the
interpreter importing torch, torch.distributed and lmforge (~2 s per process), and a torchrun job of N
ranks pays it N + 1 times. The docs' commands are ~90 such jobs, the parity tests' launches ~60 more.
Here one server process per pytest process imports all of it once; each command then starts as a fork
of it, so what runs is the real command (its own process, its own stdin/stdout/stderr, working folder,
environment and exit status) without the imports. The same idea as multiprocessing's "forkserver"
start method and Android's zygote; neither serves a command line from a shell script, hence this file.

    warm = shared()                       # starts `python tests/warm_start.py serve SOCKET` once
    env = warm.env(env)                   # PATH gets shims `lmforge`, `torchrun` and `python-warm`;
                                          # PYTHON_EXEC = python-warm, which torchrun starts its workers with
    subprocess.run(["bash", "-c", "torchrun --nproc-per-node 2 -m lmforge train"], env=env)
    subprocess.run(warm.interpreter() + ["-m", "torch.distributed.run", ..., "tests/train_runs_driver.py", ...])

A shim sends its command line, working folder, environment and its three standard file descriptors
(SCM_RIGHTS) over a Unix socket; the server forks; the child takes the descriptors as 0, 1 and 2 and
runs the command as `python -m`, `python SCRIPT` or the console script would, in a session of its
own. The shim forwards the signals a launcher sends (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2) to
the child, and ends with the child's exit status (or its signal). A child whose shim dies (SIGKILL:
a test's timeout) kills itself: it holds the socket and sees its end close. `python-warm` starts warm
`-m lmforge` (and its modules), `-m torch.distributed.run` and the tests' `*_driver.py` scripts, and anything else with
the real interpreter.

A `sitecustomize.py` on PYTHONPATH (a start-up hook: tests plant faults that way) sends the command to
the real interpreter, which runs it, unless the hook says `AFTER_IMPORTS` in its text: it only patches
what is already imported (registers a handler, replaces a function), so the child imports it before it
runs the command, after the server's imports. Other PYTHONPATH folders are added to the child's sys.path.

What differs from a fresh interpreter: the child's parent is the server, not the shim, so code that
walks its parent's children (lmforge.cli's wait for a failed launch's sibling ranks,
lmforge.train.preempt's count of live siblings) sees none, and a signal to the shim's process group
does not reach the child. Those paths (failures, signals, SIGKILLed launches) are tested with plain
interpreters: tests/test_preempt.py, test_ckpt_fault.py, test_launch.py, test_rank_health.py's stuck rank,
the launch test_node_local.py kills and test_rank0_output.py's failed launch.
"""

from __future__ import annotations

import io
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
WARM_MODULES = ("lmforge", "torch.distributed.run")
AFTER_IMPORTS = "AFTER_IMPORTS"  # a sitecustomize.py that says so runs in a warm child (the module docstring)
# What the server imports before it serves: what a training, planning, import/export or eval command
# would import itself (each line's failure only means a colder start).
PRELOAD = ("torch", "torch.distributed.run", "torch.distributed.checkpoint", "torch.distributed.optim",
           "torch.distributed.pipelining", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
           "lmforge.cli", "lmforge.launch", "lmforge.train.trainer", "lmforge.parallel.parallelize",
           "lmforge.ckpt.manager", "lmforge.cli.interop", "lmforge.cli.eval", "lmforge.cli.plan",
           "lmforge.cli.report", "lmforge.cli.sweep", "lmforge.cli.merge", "lmforge.cli.prepare",
           "safetensors.torch", "transformers")


def _send_msg(sock: socket.socket, payload: bytes, fds: list[int] = ()) -> None:
    data = struct.pack("!I", len(payload)) + payload
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("peer closed")
        buf += chunk
    return buf


# ------------------------------------------------------------------------------------------------
# the shim (runs in the shell's process tree; imports only the standard library)
# ------------------------------------------------------------------------------------------------

def shim(kind: str, socket_path: str, real_python: str, args: list[str]) -> None:
    """Run `kind` (lmforge | torchrun | python) with `args` through the server at `socket_path`."""
    hooks = [d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if d and os.path.isfile(os.path.join(d, "sitecustomize.py"))]
    if hooks and not all(AFTER_IMPORTS in Path(d, "sitecustomize.py").read_text() for d in hooks):
        # a start-up hook (a test's planted fault) that may act on imports: only a fresh interpreter runs it
        real = {"python": [real_python], "lmforge": [real_python, "-m", "lmforge"],
                "torchrun": [real_python, "-m", "torch.distributed.run"]}[kind]
        os.execv(real_python, real + list(args))
    if kind == "python":
        opts = list(args)
        while opts and opts[0] in ("-u", "-B"):
            opts.pop(0)
        if len(opts) >= 2 and opts[0] == "-m" and (opts[1] in WARM_MODULES or opts[1].startswith("lmforge.")):
            request = {"module": opts[1], "argv": [opts[1], *opts[2:]]}
        elif opts and os.path.dirname(os.path.abspath(opts[0])) == HERE and opts[0].endswith("_driver.py"):
            request = {"script": os.path.abspath(opts[0]), "argv": opts}  # the tests' drivers
        else:
            os.execv(real_python, [real_python, *args])
    else:
        request = {"entry": kind, "argv": [kind, *args]}
    request.update(cwd=os.getcwd(), env=dict(os.environ))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_path)
    _send_msg(sock, json.dumps(request).encode(), [0, 1, 2])
    child = struct.unpack("!i", _recv_exact(sock, 4))[0]

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        status = struct.unpack("!i", _recv_exact(sock, 4))[0]
    except EOFError:  # the server died
        sys.exit(255)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # ended by a signal: end by the same one, as the command itself would have
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
    sys.exit(code)


# ------------------------------------------------------------------------------------------------
# the server
# ------------------------------------------------------------------------------------------------

class _Job:
    """What a forked child runs once it has left the server's loop."""

    def __init__(self, request: dict, conn: socket.socket):
        self.request, self.conn = request, conn

    def run(self) -> None:
        request = self.request
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
            stream = io.TextIOWrapper(io.FileIO(fd, "r" if fd == 0 else "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace" if fd == 2 else "strict",
                                      line_buffering=fd != 0, write_through=unbuffered and fd != 0)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        threading.Thread(target=self._die_with_shim, daemon=True).start()
        sys.argv = list(request["argv"])
        for folder in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):  # (set after the server started)
            if folder and os.path.abspath(folder) not in sys.path:
                sys.path.insert(1, os.path.abspath(folder))
        path = [d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d]
        if any(os.path.isfile(os.path.join(d, "sitecustomize.py")) for d in path):
            sys.modules.pop("sitecustomize", None)  # (an AFTER_IMPORTS hook, the shim checked: run it as start-up would)
            import importlib

            importlib.import_module("sitecustomize")
        if "module" in request:
            import runpy

            sys.path[0] = request["cwd"]  # (as `python -m` puts the working folder first)
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        elif "script" in request:
            import runpy

            sys.path[0] = os.path.dirname(request["script"])  # (as `python SCRIPT` puts its folder first)
            runpy.run_path(request["script"], run_name="__main__")
        elif request["entry"] == "lmforge":  # the console script
            from lmforge.cli import run

            run()
        else:  # torchrun's console script
            from torch.distributed.run import main

            sys.exit(main())

    def _die_with_shim(self) -> None:
        try:
            while self.conn.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)


def serve(socket_path: str) -> _Job:
    """Accept requests and fork a child for each; returns (only in a child) the job it is to run."""
    for name in PRELOAD:
        try:
            __import__(name)
        except Exception as exc:  # noqa: BLE001 - a module that cannot import here starts cold in the child
            print(f"warm_start: {name} not preloaded ({exc})", file=sys.stderr)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}  # child pid -> its shim's connection
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                header, fds_list, _, _ = socket.recv_fds(conn, 4, 3)
                header += _recv_exact(conn, 4 - len(header))
                request = json.loads(_recv_exact(conn, struct.unpack("!I", header)[0]))
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # the child: leave the loop with the job
                    signal.set_wakeup_fd(-1)
                    for sig in (signal.SIGCHLD, signal.SIGTERM):
                        signal.signal(sig, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    selector.close()
                    listener.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    for other in waiting.values():
                        other.close()
                    os.setsid()
                    for target, fd in enumerate(fds_list):
                        os.dup2(fd, target)
                        os.close(fd)
                    return _Job(request, conn)
                for fd in fds_list:
                    os.close(fd)
                waiting[pid] = conn
                conn.sendall(struct.pack("!i", pid))
            else:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                while waiting:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = waiting.pop(pid, None)
                    if conn is not None:
                        try:
                            conn.sendall(struct.pack("!i", status))
                        except OSError:
                            pass
                        conn.close()


class WarmStart:
    """A running fork server and the shims that use it (see the module's docstring)."""

    def __init__(self, env: dict[str, str]):
        import tempfile

        # (a Unix socket's path is limited to ~100 bytes: a short folder of its own, the shims beside it)
        self.folder = Path(tempfile.mkdtemp(prefix="lmf-warm-"))
        self.socket = str(self.folder / "s")
        self.bin = self.folder / "bin"
        self.bin.mkdir()
        for kind, name in (("lmforge", "lmforge"), ("torchrun", "torchrun"), ("python", "python-warm")):
            path = self.bin / name
            path.write_text(f"#!{sys.executable} -IS\n"
                            f"import sys\nsys.path.insert(0, {HERE!r})\n"
                            f"from warm_start import shim\n"
                            f"shim({kind!r}, {self.socket!r}, {sys.executable!r}, sys.argv[1:])\n")
            path.chmod(0o755)
        self.python = str(self.bin / "python-warm")
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "warm_start.py"), "serve", self.socket],
                                     env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"warm_start: the server did not start ({line!r}, exit {self.proc.wait()})")

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with the shims first on PATH and torchrun's workers started through them."""
        return {**env, "PATH": f"{self.bin}:{env.get('PATH', '')}", "PYTHON_EXEC": self.python}

    def interpreter(self) -> list[str]:
        """A command prefix that stands for `sys.executable` (`-m torch.distributed.run`, `-m lmforge` and the
        tests' drivers start warm, the rest with the real interpreter), torchrun's workers included."""
        return ["env", f"PYTHON_EXEC={self.python}", self.python]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


_SHARED: WarmStart | None = None


def warm_exec(monkeypatch) -> WarmStart:
    """For a test: PYTHON_EXEC = the shared server's interpreter, which torchrun starts its workers with and
    `lmforge plan --verify` its runs (lmforge.verify.certify)."""
    warm = shared()
    monkeypatch.setenv("PYTHON_EXEC", warm.python)
    return warm


def shared() -> WarmStart:
    """This test process's server (started on first use, stopped when the process ends)."""
    global _SHARED
    if _SHARED is None or _SHARED.proc.poll() is not None:
        import atexit

        _SHARED = WarmStart({**os.environ, "OMP_NUM_THREADS": "1"})
        atexit.register(_SHARED.close)
    return _SHARED


def _exit_status(code) -> int:
    """sys.exit's argument as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        job = serve(sys.argv[2])  # (only a forked child returns)
        try:
            job.run()
            status = 0
        except SystemExit as exc:
            status = _exit_status(exc.code)
        except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, status 1
            import traceback

            traceback.print_exc()
            status = 1
        # the interpreter's own exit less the teardown of torch's modules, as every lmforge process ends
        from lmforge.cli import exit_now

        exit_now(status)
