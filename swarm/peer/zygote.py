"""The zygote process: imports what a ``swarm-peer`` process imports, then forks peers on request.

Tests start it through ``swarm/testing/zygote.py`` (see there for why and for the protocol). Each child does what
``Popen(["swarm-peer", *argv], stdout=log, stderr=STDOUT, start_new_session=True, cwd=cwd, env=env)`` would,
then runs ``swarm.peer.cli.main(argv)`` in the modules this process imported already.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import signal
import sys
import threading
from typing import IO, Any


def serve() -> None:
    """The zygote process: import, then fork children on request until stdin closes."""
    # Answers go to the original stdout; anything an import prints goes to stderr instead of into them.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    # Ctrl-C reaches the whole foreground group: the test process stops its peers through this one after it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import uvloop  # noqa: F401

    import swarm.peer.cli  # noqa: F401  torch and hivemind
    from swarm.models.checkpoints import offline_hub
    from swarm.models.loading import family_classes

    offline_hub()  # as a peer resolving its model does, before transformers is imported
    family_classes("llama")  # what resolving a model imports from transformers
    if threading.active_count() != 1:  # a fork copies only the forking thread: nothing may run beside it
        raise RuntimeError(
            f"the zygote runs {threading.enumerate()} after its imports; it cannot fork safely"
        )
    requests = sys.stdin.buffer
    codes: dict[int, int] = {}  # exit codes of reaped children, until asked for
    for line in requests:
        request = json.loads(line)
        try:
            if "start" in request:
                answer: dict[str, Any] = {"pid": _fork(**request["start"])}
            else:
                pid = int(request["poll"])
                _reap(codes)
                answer = {"code": codes.pop(pid, None)}
        except Exception as e:  # the test process gets it as a RuntimeError
            answer = {"error": repr(e)}
        answers.write(json.dumps(answer).encode() + b"\n")
        answers.flush()


def _reap(codes: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        codes[pid] = os.waitstatus_to_exitcode(status)


def _fork(argv: list[str], env: dict[str, str], cwd: str, log: str) -> int:
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pid = os.fork()
    if pid:
        os.close(log_fd)
        return pid
    code = 1
    try:  # the child: from here on, what `Popen(argv, stdout=log, stderr=STDOUT, start_new_session=True)` does
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.closerange(3, 1 << 16)  # the zygote's pipes and files stay out of the peer
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = _unbuffered(1)
        sys.stderr = _unbuffered(2)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["swarm-peer", *argv]
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from swarm.peer.cli import main

        try:
            code = main(argv)
        except SystemExit as e:  # argparse's errors, as in a fresh process
            code = e.code if isinstance(e.code, int) else 1
        atexit._run_exitfuncs()
    except BaseException as e:
        print(f"zygote child failed: {e!r}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _unbuffered(fd: int) -> IO[str]:
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True, line_buffering=True)


if __name__ == "__main__":
    serve()
