"""What passing the tokenizer with every ``generate_responses`` call costs (upstream's dispatch).

Upstream's samples generator sends ``hf_tokenizer=self.tokenizer`` with each of a step's calls; Ray
pickles it in the trainer and unpickles it in the rollout actor before the call starts. This sends 32
calls to an async Ray actor that does nothing, with a Qwen2.5-sized tokenizer (151,936 entries, built
locally) and without it, and prints when the last call started. OPPO's rollout actor gets the
tokenizer once (``oppo_set_tokenizer``).

    python examples/scripts/dispatch_cost_cpu.py --out runs/dispatch-cost.json
"""

import argparse
import json
import os
import pickle
import platform
import sys
import tempfile
import time

import ray
from transformers import AutoTokenizer

from openrlhf_oppo import tiny


@ray.remote
class Idle:
    async def generate_responses(self, prompt, hf_tokenizer=None):
        return time.time()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        tiny.make_tokenizer(path, args.vocab)
        tokenizer = AutoTokenizer.from_pretrained(path)
    blob = pickle.dumps(tokenizer)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = Idle.remote()
    ray.get(actor.generate_responses.remote("warm-up"))
    results = dict(calls=args.calls, vocab=args.vocab, pickled_mb=len(blob) / 1e6, cpu=platform.processor(),
                   cores=os.cpu_count())  # fmt: skip
    for name, kwargs in (("tokenizer_in_every_call", dict(hf_tokenizer=tokenizer)), ("no_tokenizer", {})):
        start = time.time()
        refs = [actor.generate_responses.remote("prompt", **kwargs) for _ in range(args.calls)]
        submitted = time.time() - start
        last_started = max(ray.get(refs)) - start
        results[name] = dict(submitted_s=submitted, last_call_started_s=last_started)
        print(
            f"{name}: {args.calls} calls submitted in {submitted:.2f} s, the last one started after {last_started:.2f} s"
        )
    ray.shutdown()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(command=" ".join(["python"] + sys.argv), **results), f, indent=1)


if __name__ == "__main__":
    main()
