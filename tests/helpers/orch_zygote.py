"""A process that has imported what every `orch` command imports (torch, Hydra, orch's CLI and
planner) and forks one child per command it is asked to run: `python -m orch ARGS` without the
seconds of imports each fresh interpreter pays. Run as a script by :mod:`helpers.orch_command`.

Each child is a real process, as `python -m orch` would be: its own pid, exit code, signals,
working directory, environment and standard streams (received over the socket), the working
directory and ``PYTHONPATH`` first on its import path, and the interpreter's ending (non-daemon
threads joined, ``atexit`` handlers run, an uncaught KeyboardInterrupt ending it by SIGINT).
What it cannot show is what happens while orch itself is imported: tests of that (start-up order,
a user's folders named like orch's packages) start a fresh interpreter.

Nothing is imported here that reads the environment or the working directory at import time
(Ray, DeepSpeed, transformers read theirs): each command brings its own and imports them itself.
The modules preloaded start no thread, so forking is safe.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys

PRELOADED = ("torch", "torch._dynamo", "hydra", "omegaconf", "mlflow", "orch.__main__", "orch.cli",
             "orch.checking", "orch.plans.step_time.prediction")
MAX_MESSAGE = 1 << 20


def _child(request: dict, fds: list[int], closing: list[socket.socket]) -> None:
    """Become `python -m orch *request["args"]` in ``request["cwd"]`` with ``request["env"]``; never returns."""
    code = 1
    try:
        for sock in closing:
            sock.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if request["new_session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import tempfile

        tempfile.tempdir = None  # read from TMPDIR again, as a fresh interpreter would
        if os.environ.get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *extra, *BASE_PATH]
        import orch.__main__

        sys.argv = [orch.__main__.__file__, *request["args"]]
        try:
            code = orch.__main__.main()
        except SystemExit as exiting:
            code = exiting.code
        except KeyboardInterrupt:
            import traceback

            traceback.print_exc()
            _finish()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:  # noqa: BLE001 - the interpreter prints it and exits 1
            import traceback

            traceback.print_exc()
            code = 1
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        _finish()
    finally:
        os._exit(code if isinstance(code, int) else 1)


def _finish() -> None:
    """What the interpreter does at its end: join non-daemon threads, run ``atexit``, flush."""
    import atexit
    import threading

    try:
        threading._shutdown()  # noqa: SLF001 - what Py_FinalizeEx calls
    except Exception:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a reader that went away
            pass


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_read, selectors.EVENT_READ, "reap")
    parent = os.getppid()
    print("ready", flush=True)
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=1.0):
            if key.data == "accept":
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
                request = json.loads(message)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, fds, [listener, conn, *children.values()])
                for fd in fds:
                    os.close(fd)
                conn.send(json.dumps({"pid": pid}).encode())
                children[pid] = conn
            else:
                os.read(wake_read, 4096)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass  # the test that asked is gone
                conn.close()


if __name__ == "__main__":
    own = os.path.dirname(os.path.abspath(__file__))
    inherited = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    BASE_PATH = [p for p in sys.path if p and os.path.abspath(p) != own and p not in inherited]
    import importlib

    for module in PRELOADED:
        importlib.import_module(module)
    serve(sys.argv[1])
