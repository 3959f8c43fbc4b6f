"""Bad inputs of every kind, each refused before Ray starts in one line, and the page that lists them.

    python -m openrlhf_oppo.testing.preflight_sweep    # rewrites docs/preflight.md

Each case changes one thing in a good run (a command line on a sandbox of data files and checkpoint configs)
and records the line the CLI prints for it (``openrlhf-oppo: error: ...``). ``tests/test_preflight.py`` checks
that every case is refused in one line and that ``docs/preflight.md`` is the page ``page`` writes.
"""

import copy
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

from openrlhf_oppo import preflight, tiny
from openrlhf_oppo.config import OPPOConfigError

PAGE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "preflight.md")
# The machine of the good run: room for its five GPU groups of one GPU.
MACHINE = {"GPU": 8, "CPU": 16}
READ_ONLY = "/proc/1"  # a folder nobody can create files in, root included
ROOT = "<tmp>"  # the sandbox's folder, as the page shows it


def good_argv(root: str) -> List[str]:
    """A run that passes every check: OPPO on, one GPU a model and one engine, files in the sandbox."""
    argv = [
        "--actor.model_name_or_path", f"{root}/models/actor",
        "--reward.model_name_or_path", f"{root}/models/reward",
        "--critic.model_name_or_path", f"{root}/models/reward",
        "--data.prompt_dataset", f"{root}/data/prompts.jsonl",
        "--data.input_key", "input",
        "--data.label_key", "answer",
        "--data.max_len", "1024",
        "--ckpt.output_dir", f"{root}/out/ckpt",
        "--ckpt.path", f"{root}/out/checkpoints",
        "--logger.tensorboard_dir", f"{root}/out/tb",
        "--vllm.num_engines", "1",
        "--rollout.batch_size", "8",
        "--train.batch_size", "8",
        "--oppo.enable",
        "--oppo.trace_dir", f"{root}/out/trace",
    ]  # fmt: skip
    for role in ("actor", "critic", "reward", "ref"):
        argv += [f"--{role}.num_gpus_per_node", "1"]
    return argv


def build_sandbox(root: str) -> None:
    """Data files good and bad, checkpoint folders (their config.json: what the checks read), and a workload
    folder as the benchmark lays it out."""
    rows = [{"input": f"{i}+1=", "answer": str(i + 1), "length": "8"} for i in range(4)]
    other = [{"question": row["input"]} for row in rows]
    files = {
        "data/prompts.jsonl": "".join(json.dumps(row) + "\n" for row in rows),
        "data/broken_row.jsonl": "".join(json.dumps(row) + "\n" for row in rows[:2]) + '{"input": "2+1=", "answer"\n',
        "data/row_without_input.jsonl": "".join(json.dumps(row) + "\n" for row in rows[:2] + other[2:]),
        "data/two_types.jsonl": "".join(
            json.dumps(dict(row, answer=i + 1 if i else str(i + 1))) + "\n" for i, row in enumerate(rows)
        ),
        "data/ragged.csv": "input,answer\n1+1=,2\n2+1=,3,extra\n",
        "data/empty.jsonl": "",
        "data/blank.jsonl": "\n\n",
        "data/question.jsonl": "".join(json.dumps(row) + "\n" for row in other),
        "data/no_answer.jsonl": json.dumps({"input": "1+1="}) + "\n",
        "data/not_json.jsonl": "input: 1+1=\n",
        "data/list.jsonl": "[1, 2]\n",
        "data/empty_array.json": "[]",
        "data/question_array.json": json.dumps(other),
        "data/question.csv": "question\n1+1=\n",
        "data/prompts.txt": "1+1=\n",
        "data/question_folder/train.jsonl": json.dumps(other[0]) + "\n",
        "data/broken.parquet": "not parquet",
        "bench/prompts.jsonl": "".join(json.dumps(row) + "\n" for row in rows),
        "a_file": "",
    }
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        with open(os.path.join(root, name), "w") as f:
            f.write(text)
    os.makedirs(os.path.join(root, "data", "empty_folder"), exist_ok=True)
    _write_parquet(root)
    for name, shape in (("actor", "tiny"), ("reward", "tiny"), ("7b", "qwen2.5-7b")):
        for folder in (f"models/{name}", f"bench/models/{name}"):
            os.makedirs(os.path.join(root, folder), exist_ok=True)
            with open(os.path.join(root, folder, "config.json"), "w") as f:
                json.dump(dict(model_type="qwen2", **tiny.SHAPES[shape]), f)
    os.makedirs(os.path.join(root, "models", "no_config"), exist_ok=True)
    os.makedirs(os.path.join(root, "models", "bad_config"), exist_ok=True)
    with open(os.path.join(root, "models", "bad_config", "config.json"), "w") as f:
        f.write('{"model_type": "qwen2", "hidden_size": 64,}\n')
    # The actor's tokenizer counts the prompts against --data.max_len (one token a byte).
    tiny.make_tokenizer(os.path.join(root, "models", "actor"), tiny.SHAPES["tiny"]["vocab_size"])


def _write_parquet(root: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet

    pyarrow.parquet.write_table(pa.table({"question": ["1+1="]}), os.path.join(root, "data", "question.parquet"))
    pyarrow.parquet.write_table(
        pa.table({"input": pa.array([], pa.string())}), os.path.join(root, "data", "none.parquet")
    )


@dataclass
class Case:
    """One bad input: ``flags`` (dotted name -> value, ``{root}`` the sandbox) set on the good run's parsed args,
    or a whole command line (``argv``, parsed: a benchmark system's), checked on ``machine``."""

    category: str
    what: str
    flags: Sequence[Tuple[str, object]] = ()
    argv: Optional[Callable[[str], List[str]]] = None
    machine: dict = field(default_factory=lambda: dict(MACHINE))

    def shown(self) -> str:
        """What the page's Input column says: the case, its flags, and its machine where it is not the good run's."""
        given = [
            f"--{name}" if value is True else f"no --{name}" if value is None else f"--{name} {value}"
            for name, value in self.flags
        ]
        gpus, cpus = preflight.plural(self.machine["GPU"], "GPU"), preflight.plural(self.machine["CPU"], "CPU")
        machine = "" if self.machine == MACHINE else f", on a machine of {gpus} and {cpus}"
        flags = f": `{' '.join(given).replace('{root}', ROOT)}`" if given else ""
        return f"{self.what}{machine}{flags}"


def _bench(system: str, placement: str, gpus: int, workload: str = "bench") -> Callable[[str], List[str]]:
    from openrlhf_oppo.bench.systems import common_flags, system_flags

    def argv(root: str) -> List[str]:
        flags = common_flags(f"{root}/{workload}", f"{root}/out", system, placement, gpus, 16, 1, 5, 256, 16, 0, 2.0)
        return flags + system_flags(system, placement, 4)

    return argv


D, F, M, R, B, C, S = "datasets", "folders", "model paths", "resources", "budgets", "flag combinations", "benchmark"
L = "batch and lengths"
CASES = [
    Case(D, "a prompt file that does not exist", [("data.prompt_dataset", "{root}/data/missing.jsonl")]),
    Case(D, "a relative data file that does not exist", [("data.prompt_dataset", "prompts-nowhere.jsonl")]),
    Case(D, "a file under ~ that does not exist", [("data.prompt_dataset", "~/no/prompts.jsonl")]),
    Case(D, "an empty file", [("data.prompt_dataset", "{root}/data/empty.jsonl")]),
    Case(D, "blank lines only", [("data.prompt_dataset", "{root}/data/blank.jsonl")]),
    Case(D, "rows without the input key", [("data.prompt_dataset", "{root}/data/question.jsonl")]),
    Case(D, "rows without the label key", [("data.prompt_dataset", "{root}/data/no_answer.jsonl")]),
    Case(D, "a first line that is not JSON", [("data.prompt_dataset", "{root}/data/not_json.jsonl")]),
    Case(D, "a first row that is a list", [("data.prompt_dataset", "{root}/data/list.jsonl")]),
    Case(D, "an empty JSON array", [("data.prompt_dataset", "{root}/data/empty_array.json")]),
    Case(D, "a JSON array without the input key", [("data.prompt_dataset", "{root}/data/question_array.json")]),
    Case(D, "a parquet file without the input column", [("data.prompt_dataset", "{root}/data/question.parquet")]),
    Case(D, "a parquet file without rows", [("data.prompt_dataset", "{root}/data/none.parquet")]),
    Case(D, "a file that is not parquet", [("data.prompt_dataset", "{root}/data/broken.parquet")]),
    Case(D, "a CSV file without the input column", [("data.prompt_dataset", "{root}/data/question.csv")]),
    Case(D, "a later row that is not JSON", [("data.prompt_dataset", "{root}/data/broken_row.jsonl")]),
    Case(D, "a later row without the input key", [("data.prompt_dataset", "{root}/data/row_without_input.jsonl")]),
    Case(D, "a key of two types", [("data.prompt_dataset", "{root}/data/two_types.jsonl")]),
    Case(D, "a CSV row with a field too many", [("data.prompt_dataset", "{root}/data/ragged.csv")]),
    Case(D, "a file type upstream does not load", [("data.prompt_dataset", "{root}/data/prompts.txt")]),
    Case(D, "a folder without data files", [("data.prompt_dataset", "{root}/data/empty_folder")]),
    Case(D, "a folder whose data lack the input key", [("data.prompt_dataset", "{root}/data/question_folder")]),
    Case(
        D,
        "the second of two datasets missing",
        [
            ("data.prompt_dataset", "{root}/data/prompts.jsonl,{root}/data/gone.jsonl"),
            ("data.prompt_probs", "0.5,0.5"),
        ],
    ),
    Case(D, "an evaluation file that does not exist", [("eval.dataset", "{root}/data/heldout.jsonl")]),
    Case(D, "an evaluation file without the input key", [("eval.dataset", "{root}/data/question.jsonl")]),
    Case(F, "a checkpoint folder that is a file", [("ckpt.output_dir", "{root}/a_file")]),
    Case(F, "a checkpoint folder under a file", [("ckpt.output_dir", "{root}/a_file/ckpt")]),
    Case(
        F,
        "checkpoints saved where nothing can be written",
        [("ckpt.path", f"{READ_ONLY}/ckpt"), ("ckpt.save_steps", 10)],
    ),
    Case(F, "tensorboard logs where nothing can be written", [("logger.tensorboard_dir", f"{READ_ONLY}/tb")]),
    Case(F, "traces under a file", [("oppo.trace_dir", "{root}/a_file/trace")]),
    Case(M, "an actor checkpoint that does not exist", [("actor.model_name_or_path", "{root}/models/gone")]),
    Case(M, "an actor folder without config.json", [("actor.model_name_or_path", "{root}/models/no_config")]),
    Case(M, "an actor whose config.json is not JSON", [("actor.model_name_or_path", "{root}/models/bad_config")]),
    Case(M, "a reward model that is a file", [("reward.model_name_or_path", "{root}/a_file")]),
    Case(M, "the second of two reward models missing", [("reward.model_name_or_path", "{root}/models/reward,./gone")]),
    Case(M, "a relative critic path that does not exist", [("critic.model_name_or_path", "./models/critic")]),
    Case(M, "a reward function file that does not exist", [("reward.remote_url", "{root}/reward.py")]),
    Case(M, "an agent file that does not exist", [("train.agent_func_path", "{root}/agent.py")]),
    Case(M, "no reward at all", [("reward.model_name_or_path", None), ("critic.model_name_or_path", None)]),
    Case(M, "no actor model", [("actor.model_name_or_path", None)]),
    Case(R, "the good run", machine={"GPU": 0, "CPU": 16}),
    Case(R, "the good run", machine={"GPU": 4, "CPU": 16}),
    Case(R, "the good run", machine={"GPU": 8, "CPU": 4}),
    Case(R, "upstream's default of 8 GPUs a model", [(f"{g}.num_gpus_per_node", 8) for g in ("actor", "critic")]),
    Case(
        R,
        "two nodes of 4 GPUs on one machine",
        [(f"{g}.{n}", v) for g in ("actor", "ref") for n, v in (("num_nodes", 2), ("num_gpus_per_node", 4))],
    ),
    Case(
        R,
        "everything colocated on more GPUs than there are",
        [("train.colocate_all", True), ("actor.num_gpus_per_node", 4), ("vllm.num_engines", 4)],
        machine={"GPU": 2, "CPU": 16},
    ),
    Case(B, "a budget below one sequence's KV cache", [("oppo.cache_budget_gb", 1e-5)]),
    Case(
        B,
        "a budget below one long sequence of a 7B model",
        [("actor.model_name_or_path", "{root}/models/7b"), ("data.max_len", 32768), ("oppo.cache_budget_gb", 1.0)],
    ),
    Case(
        B,
        "a budget below the critic's sequence (larger than the actor)",
        [("critic.model_name_or_path", "{root}/models/7b"), ("data.max_len", 8192), ("oppo.cache_budget_gb", 0.25)],
    ),
    Case(L, "no prompts a step", [("rollout.batch_size", 0)]),
    Case(L, "no prompts a step, without inter-step overlap", [("rollout.batch_size", 0), ("oppo.max_lag", 0)]),
    Case(L, "no tokens a response", [("rollout.max_new_tokens", 0)]),
    Case(L, "a negative response limit", [("rollout.max_new_tokens", -1)]),
    Case(L, "a training batch above a step's samples", [("train.batch_size", 64)]),
    Case(L, "fewer micro-batches than actor ranks", [("actor.num_gpus_per_node", 4), ("rollout.micro_batch_size", 4)]),
    Case(L, "a response limit that leaves no room for a prompt", [("rollout.max_new_tokens", 1024)]),
    Case(
        L,
        "a length limit below the longest prompt and the response",
        [("data.max_len", 64), ("rollout.max_new_tokens", 62)],
    ),
    Case(C, "a bound of Delta while inter-step overlap is off", [("oppo.max_lag", 0), ("oppo.overcommit_min", 2)]),
    Case(C, "no prompt dataset", [("data.prompt_dataset", None)]),
    Case(C, "a split a single file does not have", [("data.prompt_split", "test")]),
    Case(
        C,
        "an evaluation split a single file does not have",
        [("eval.dataset", "{root}/data/prompts.jsonl"), ("eval.split", "validation")],
    ),  # fmt: skip
    Case(
        C,
        "a critic file while the reward is remote",
        [("reward.remote_url", "http://rm"), ("critic.model_name_or_path", "{root}/a_file")],
    ),  # fmt: skip
    Case(
        S,
        "oppo-both, split on 2 GPUs",
        argv=_bench("oppo-both", "split", 2),
        machine={"GPU": 1, "CPU": 16},
    ),  # fmt: skip
    Case(
        S,
        "upstream-async, split on 4 GPUs",
        argv=_bench("upstream-async", "split", 4),
        machine={"GPU": 2, "CPU": 16},
    ),  # fmt: skip
    Case(
        S,
        "oppo-both-awake, colocated on 1 GPU",
        argv=_bench("oppo-both-awake", "colocated", 1),
        machine={"GPU": 0, "CPU": 16},
    ),  # fmt: skip
    Case(S, "upstream-sync before its workload is built", argv=_bench("upstream-sync", "split", 2, "unbuilt")),
]


def _set(args, dotted: str, value) -> None:
    *groups, name = dotted.split(".")
    target = args
    for group in groups:
        target = getattr(target, group)
    setattr(target, name, value)


def refusal(case: Case, good, root: str) -> Optional[str]:
    """The line the CLI would print for ``case``, or None if it passes: ``preflight.check_flags`` and
    ``preflight.check`` as ``configure`` runs them, then ``preflight.check_launch`` on the case's machine."""
    from openrlhf_oppo.bench.driver import parse_args  # the benchmark's cases carry its workload flags

    try:
        if case.argv is not None:
            args = parse_args(case.argv(root))
        else:
            args = copy.deepcopy(good)
            for dotted, value in case.flags:
                _set(args, dotted, value.replace("{root}", root) if isinstance(value, str) else value)
            preflight.check_flags(args)
            preflight.check(args)
        preflight.check_launch(args, case.machine, "this machine")
    except OPPOConfigError as error:
        return str(error)
    return None


def sweep(root: str) -> List[Tuple[Case, Optional[str]]]:
    """Every case on a sandbox built in ``root``, with the line it is refused with (the sandbox shown as
    ``<tmp>``)."""
    from openrlhf_oppo.cli.train_ppo_ray import parse_args

    build_sandbox(root)
    good = parse_args(good_argv(root))
    results = []
    for case in CASES:
        line = refusal(case, good, root)
        results.append((case, line.replace(root, ROOT) if line else None))
    return results


HEADER = """# Preflight: bad runs refused in one line before Ray starts

Generated by `python -m openrlhf_oppo.testing.preflight_sweep` (`tests/test_preflight.py` checks it is current).

`openrlhf_oppo/preflight.py` checks what a run's flags point at, before Ray starts; each problem is one line,
`openrlhf-oppo: error: ...`, that names the flag or path and what to change. A parser error is one line too, with
`(see --help)` in place of the usage of every option, and an assertion of upstream's own checks of its flags ends
the run with its message. The notices the libraries print as they import (pynvml, Triton, DeepSpeed's
accelerator), which ask nothing of the user, go to a log file (`openrlhf_oppo/quiet.py` names it;
`OPENRLHF_OPPO_VERBOSE=1` shows them), so the run's first line is its own.

* From `extension.configure`, for every run through `python -m openrlhf_oppo.cli.train_ppo_ray` or upstream's
  patched driver, OPPO on or off, first the batch and length flags (counts of at least one, a training batch no
  larger than a step's samples, a response limit that leaves a prompt room in `--data.max_len`, a micro-batch for
  each actor rank; left at upstream's default 128, a training batch above a step's samples is warned of), then
  the datasets (exist, not empty, every row parses and has the input and label keys, each of one type: a JSON,
  JSON lines or CSV file read through up to 64 MiB, else its first 10000 rows; local files and folders only: a hub
  name is not checked offline), the prompts read against `--data.max_len` (built as upstream builds them, counted
  with the actor's tokenizer where it is a local folder), the folders the run writes (the folder or its first
  existing parent is a writable folder; nothing is created), the local model checkpoints (a `config.json`
  transformers can read), a local reward function or agent file, and with `--oppo.enable` the KV cache budget
  against one sequence at `--data.max_len` in each streamed model.
* When the CLI starts a run (not in `parse_args`, which tests and the demo use without GPUs):
  `--actor.model_name_or_path` and `--data.prompt_dataset` given, and the GPUs and CPUs the placement asks for,
  against the Ray cluster if Ray is up, or this machine if Ray is about to start here; a cluster named by
  `RAY_ADDRESS` is checked once Ray is up, at the run's first placement group.
* While the run places its models, each placement group waits at most 30 s for its GPUs
  (`OPENRLHF_OPPO_PLACEMENT_TIMEOUT_S`, longer where an autoscaler adds nodes), where Ray would wait forever.

The placement (upstream 0.11.2's `train`): the actor has its GPUs; the reference shares them under
`--train.colocate_actor_ref` or `--train.colocate_all`; critic and reward share the critic's under
`--train.colocate_critic_reward`, else the actor's under `--train.colocate_all`; the vLLM engines share the actor's
under `--train.colocate_all` (not in async mode); any other model has GPUs of its own. `--oppo.colocate_models`
puts every model on the actor's GPUs and the engines on their own (reward and reference beside the engines with
`--oppo.frozen_scorers_on generation`). Each GPU takes one CPU, and the trainer one more.

When an actor fails once the run is going, the run ends with one line naming the actor by role and rank and its
own error (`critic rank 1 (CriticModelActor) failed in fit: RuntimeError: CUDA out of memory ...`, or `failed to
start` for an error in `__init__`, or `died` with Ray's reason), before the traceback and again as the last line.

## The sweep

Each row changes one thing in a good run (OPPO on, one GPU a model and one vLLM engine, on a machine of 8 GPUs
and 16 CPUs); `<tmp>` is the sandbox folder.

| Input | Category | Line printed after `openrlhf-oppo: error:` |
|---|---|---|
"""


def page(results) -> str:
    rows = [f"| {case.shown()} | {case.category} | {(line or 'PASSED').replace('|', '/')} |" for case, line in results]
    return HEADER + "\n".join(rows) + "\n"


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = sweep(root)
    passed = [case.what for case, line in results if line is None]
    if passed:
        sys.exit(f"not refused: {passed}")
    with open(PAGE, "w") as f:
        f.write(page(results))
    print(f"wrote {os.path.normpath(PAGE)}: {len(results)} cases")


if __name__ == "__main__":
    main()
