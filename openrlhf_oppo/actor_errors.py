"""The root cause of a Ray actor's failure, in one line: which actor (its role and rank), and its own error.

Ray hands the driver an error several layers deep: a ``RayTaskError`` for the call that waited (the trainer's
``fit``) whose ``cause`` is the actor's own exception, with the actor itself named only in the text; or an
``ActorDiedError`` whose text holds the ``__init__`` traceback of an actor that failed to start, or the
reason its process died. The functions here read those; ``NAMES`` maps the actor ids the driver created to
"critic rank 1" (filled by ``launch.py``), and an actor it does not know is named by its class.
"""

import re
from typing import Dict, Optional, Tuple

from ray.exceptions import RayActorError, RayTaskError

# actor id (hex) -> "critic rank 1", for the actors the driver created.
NAMES: Dict[str, str] = {}

# The models' roles by their class names (upstream's and OPPO's subclasses), as upstream's flags name them.
ROLES = (
    ("Policy", "actor"),
    ("Critic", "critic"),
    ("Reward", "reward"),
    ("Reference", "ref"),
    ("Rollout", "vLLM engine"),
    ("Trainer", "trainer"),
    ("TrainingActor", "trainer"),
)
# The longest message kept of the actor's own error.
MESSAGE_CHARS = 400

_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
# The header Ray writes for a failed actor call: "ray::CriticModelActor.fit() (pid=1, ip=1.2.3.4, actor_id=ab12, ...".
_ACTOR_CALL = re.compile(r"ray::(\w+)\.(\w+)\(\) \(pid=\d+, ip=[^,)]+, actor_id=(\w+)")
_CLASS_NAME = re.compile(r"class_name: (\S+)")


def role(class_name: str) -> Optional[str]:
    for part, name in ROLES:
        if part in class_name:
            return name
    return None


def register(handles, class_name: str) -> None:
    """Name the actors of a group by their rank (their index, as in upstream's ``RayActorGroup``)."""
    name = role(class_name) or class_name
    for rank, handle in enumerate(handles):
        NAMES[handle._actor_id.hex()] = f"{name} rank {rank}"


def text(error: BaseException) -> str:
    return _COLOUR.sub("", str(error))


def innermost_call(error: BaseException) -> Optional[Tuple[str, str, str]]:
    """(class, method, actor id) of the deepest actor call in the error's text: the one that failed."""
    calls = _ACTOR_CALL.findall(text(error))
    return calls[-1] if calls else None


def actor_class(error: RayActorError) -> str:
    """The class of the actor a Ray error says died or failed to start."""
    found = _CLASS_NAME.search(text(getattr(error, "cause", None) or error))
    if found:
        return found.group(1)
    call = innermost_call(error)
    return call[0] if call else "a Ray actor"


def name(actor_id: Optional[str], class_name: str) -> str:
    """ "critic rank 1 (CriticModelActor)" for an actor the driver named, else its class."""
    known = NAMES.get(actor_id or "")
    return f"{known} ({class_name})" if known else class_name


def exception_line(error: BaseException) -> str:
    """The actor's own error as "Type: message" (its first line): the cause of a failed call, the exception an
    actor's ``__init__`` raised, or the reason Ray gives for a dead actor."""
    while isinstance(error, RayTaskError) and getattr(error, "cause", None) is not None:
        error = error.cause
    if isinstance(error, RayActorError):
        lines = text(error).splitlines()
        if error.actor_init_failed:
            return _shorten(_raised_line(lines))
        reason = [line for line in lines if line.startswith("The actor is dead")]
        return _shorten(reason[0] if reason else lines[0] if lines else type(error).__name__)
    message = text(error).strip().splitlines()
    return _shorten(f"{type(error).__name__}: {message[0]}" if message else type(error).__name__)


def _raised_line(lines) -> str:
    """In a traceback's text, the line that names the exception: the first unindented line after the last frame."""
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    after = lines[frames[-1] + 1 :] if frames else lines
    raised = [line for line in after if line.strip() and not line.startswith((" ", "\t"))]
    return raised[0] if raised else (lines[-1] if lines else "the actor failed in __init__")


def _shorten(line: str) -> str:
    line = line.strip()
    return line if len(line) <= MESSAGE_CHARS else line[: MESSAGE_CHARS - 3] + "..."
