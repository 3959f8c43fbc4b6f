"""The processes a rollout actor starts end with it.

vLLM's engine core is a child process that does not watch its parent: when the actor dies without a shutdown
(Ray's head stopped, its raylet killed), the engine core lives on and keeps its GPU memory. A watchdog in a
process group of its own, so that it outlives the actor, stops those children once the actor is gone. It can
go once vLLM's engine core watches its parent itself.
"""

import os
import subprocess
import sys

import psutil

_WATCHDOG = """
import os, signal, sys, time
parent, children = int(sys.argv[1]), [int(pid) for pid in sys.argv[2:]]
def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
while alive(parent):
    time.sleep(1)
for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 0)):
    for pid in children:
        if alive(pid):
            os.kill(pid, sig)
    deadline = time.time() + grace
    while time.time() < deadline and any(alive(pid) for pid in children):
        time.sleep(0.2)
"""


def end_children_with_this_process() -> None:
    """Stop this process's children (the engine core, multiprocessing's resource tracker) when it dies."""
    children = [str(child.pid) for child in psutil.Process().children(recursive=True)]
    if children:
        subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), *children],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
