"""The processes a rollout actor starts end with it.

vLLM's engine core runs in a child process of the rollout actor and does not watch its parent. When the actor
dies without a shutdown (Ray's head stopped, its raylet killed), nothing ends the engine core, which keeps its
GPU memory. ``end_children_with_this_process`` starts a small watchdog, detached from the actor (a process
group of its own) so that it outlives the actor, which stops those children once the actor's process is gone.
It can go once vLLM's engine core watches its parent itself (vllm-project/vllm#55510).
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
