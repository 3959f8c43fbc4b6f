"""What crosses processes between the trainer, the rollout actors and the scoring actors.

The four scoring models are named by role everywhere (options, classes, metrics, traces): ``policy`` (old
log-probs), ``critic`` (values), ``reward`` and ``reference`` (log-probs for the KL term); upstream's option
groups call the policy ``actor`` and the reference ``ref``.

Settings are sent once when the trainer connects (``ScorerSettings``, ``StreamSettings``). Messages, in the order
a sequence meets them: ``Chunk`` (rollout -> scorer), ``StreamInfo`` (rollout -> trainer, filed as
``experience.stream``), ``ScoredSequence`` (scorer -> trainer); ``ScorerStats`` and ``ResourceReading`` once a
step.
"""

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import psutil
import torch

ROLES = ("policy", "critic", "reward", "reference")
# The frozen roles: their weights never change, so their scores never go stale.
FROZEN_ROLES = ("reward", "reference")


@dataclass
class ScorerSettings:
    """How a scoring actor builds its ``ChunkScorer`` (``--oppo.cache_budget_gb``, ``--rollout.temperature``,
    ``--oppo.max_prefill_tokens``, ``--oppo.max_prefill_cached_tokens``)."""

    cache_budget_bytes: int
    temperature: float
    max_tokens_per_forward: int
    max_cached_tokens_per_forward: int
    trace: bool = False


@dataclass
class StreamSettings:
    """How a rollout actor streams (``--oppo.chunk_size``, ``--oppo.prefill_calls_in_flight``,
    ``--oppo.flush_interval_ms``); ``salt_prompts`` where requests outlive weight updates."""

    chunk_size: int
    salt_prompts: bool
    calls_in_flight: int
    flush_interval_s: float
    trace: bool = False


@dataclass
class Chunk:
    """Tokens ``tokens`` of sequence ``uid``, starting at absolute position ``start``."""

    uid: str
    start: int
    tokens: List[int]
    prompt_len: int
    final: bool = False


@dataclass
class StreamInfo:
    """A finished sample as its rollout actor streamed it.

    ``ranks`` names, for each role the sample was streamed to, the rank of that role's group that holds
    its scores (the same rank got every chunk). Empty when the sample was not streamed.
    """

    uid: str
    prompt_len: int
    first_version: Optional[int] = None  # weight version of the sample's first and last token
    last_version: Optional[int] = None
    last_token_time: float = 0.0
    length: int = 0  # prompt + response tokens, as training sees them
    ranks: Dict[str, int] = field(default_factory=dict)
    replaced_uid: Optional[str] = None  # a stream closed because training sees other tokens: to discard

    @property
    def streamed(self) -> Tuple[str, ...]:
        return tuple(self.ranks)


@dataclass
class ScoredSequence:
    """A scoring actor's result for a finished sequence.

    ``output`` is None when the sequence could not be scored from its stream (a chunk went missing); the
    experience maker then scores it the upstream way.
    """

    uid: str
    output: Optional[torch.Tensor]
    length: int
    prompt_len: int
    version: int  # the scorer's weight version that computed ``output``
    prefilled: List[Tuple[float, int]] = field(default_factory=list)  # (when a prefill ended, its tokens)
    tokens: List[int] = field(default_factory=list)  # to score it again if the weights change first

    def tokens_prefilled_before(self, when: float) -> int:
        return sum(tokens for done, tokens in self.prefilled if done <= when)


@dataclass
class ScorerStats:
    """One scoring actor's counters: totals since set-up, and the prefill calls since the last report.

    ``calls``: ``(wall-clock start, seconds, new tokens)`` per prefill call. ``waiting``: finished sequences not
    collected yet; ``tombstones``: discarded sequences whose last chunk has not landed. Both stay small unless
    something leaks. ``streaming_off``: a prefill ran out of GPU memory, and this scorer streams no more for the rest
    of the run; the experience maker scores its sequences with upstream's forward.
    """

    calls: List[Tuple[float, float, int]]
    busy_s: float  # seconds spent in prefill calls since set-up
    streamed_tokens: int  # tokens prefilled before their sequence's last chunk arrived
    final_tokens: int
    forwards: int
    evictions: int
    cached_bytes: int
    waiting: int
    tombstones: int
    streaming_off: bool = False


@dataclass
class ResourceReading:
    """One actor process's GPU memory (PyTorch's allocated and reserved; ``num_alloc_retries`` counts cache
    flushes, a sign of fragmentation), resident host memory, and CPU seconds with its children (the engine core).
    vLLM's own GPU memory lives in the engine's process and is not counted here.

    ``phase_peaks``: phase -> (peak allocated, peak reserved) bytes since the start, as ``PhasePeaks`` records them
    in a model actor (``streaming.actors.PhasePeaks``); what the memory plan estimates per role and phase (docs/memory.md).
    """

    gpu_allocated_bytes: int
    gpu_reserved_bytes: int
    gpu_alloc_retries: int
    host_bytes: int
    cpu_s: float
    phase_peaks: Dict[str, Tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def of_this_process(cls, phase_peaks: Optional[Dict[str, Tuple[int, int]]] = None) -> "ResourceReading":
        cuda = cuda_in_use()
        return cls(
            gpu_allocated_bytes=torch.cuda.memory_allocated() if cuda else 0,
            gpu_reserved_bytes=torch.cuda.memory_reserved() if cuda else 0,
            gpu_alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0,
            host_bytes=_resident_bytes(),
            cpu_s=_cpu_seconds(),
            phase_peaks=dict(phase_peaks or {}),
        )


def cuda_in_use() -> bool:
    """This process has a CUDA context (an actor that never touched the GPU reads no CUDA memory)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _cpu_seconds() -> float:
    """User and system CPU time of this process and of its live child processes."""
    me = psutil.Process()
    total = 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:  # a child that ended in between
            continue
        total += times.user + times.system
    return total


def _resident_bytes() -> int:
    """This process's resident set size (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
