"""A Python interpreter that imports its stack once and runs each snippet in a fork of itself.

A snippet's fork starts where the imports left off and ends as an interpreter ends (its exit functions run, Ray's
shutdown among them): whatever it changes (a module's globals, a Ray cluster it starts) goes with it, as in a
fresh interpreter, without the half a minute of imports that a new interpreter of the stack costs on a small
machine. The forks share the server's random state, though: a check of what differs between two processes needs
two fresh interpreters.

``ForkingPython(preamble)`` starts the server, which runs ``preamble`` (the imports) first; ``run(code)`` returns a
``CompletedProcess`` of the snippet's fork.
"""

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback


class ForkingPython:
    def __init__(self, preamble: str, timeout_s: int = 300):
        self.timeout_s = timeout_s
        self.server = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        ready = self._send(preamble)
        assert ready["returncode"] == 0, ready["stderr"][-4000:]

    def run(self, code: str) -> subprocess.CompletedProcess:
        done = self._send(code)
        return subprocess.CompletedProcess(code, done["returncode"], done["stdout"], done["stderr"])

    def close(self):
        self.server.stdin.close()
        self.server.wait(timeout=60)

    def _send(self, code: str) -> dict:
        self.server.stdin.write(json.dumps(dict(code=code, timeout_s=self.timeout_s)) + "\n")
        self.server.stdin.flush()
        line = self.server.stdout.readline()
        assert line, f"the forking interpreter ended (exit code {self.server.wait()})"
        return json.loads(line)


def _serve():
    replies = os.fdopen(os.dup(1), "w")
    with tempfile.TemporaryFile("w+") as log:
        # What the server itself prints (the imports' warnings) goes to a log, not among the replies.
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        requests = (json.loads(line) for line in sys.stdin)
        # The preamble runs in the server itself: what it imports, every fork starts with.
        status = _run(next(requests)["code"])
        sys.stdout.flush()
        sys.stderr.flush()
        log.seek(0)
        replies.write(json.dumps(dict(returncode=status, stdout="", stderr=log.read())) + "\n")
        replies.flush()
        for request in requests:
            replies.write(json.dumps(_fork_and_run(request["code"], request["timeout_s"])) + "\n")
            replies.flush()


def _fork_and_run(code: str, timeout_s: int) -> dict:
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.alarm(timeout_s)  # a snippet that hangs ends with SIGALRM
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            status = _run(code)
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return dict(returncode=os.waitstatus_to_exitcode(status), stdout=out.read(), stderr=err.read())


def _run(code: str) -> int:
    try:
        exec(compile(code, "<snippet>", "exec"), {"__name__": "__main__"})
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    except BaseException:  # noqa: BLE001 - reported as the snippet's exit code 1
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    _serve()
