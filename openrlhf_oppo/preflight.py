"""Checks of what a run's flags point at, before Ray starts: one line per problem, naming the flag and the fix.

``plan.resolve`` checks the flags against each other; this module looks at the files, folders and machine
they name, which would otherwise fail minutes later inside a Ray actor with a traceback. Each failure is one
``config.OPPOConfigError`` (the CLI prints it as ``openrlhf-oppo: error: ...`` and exits).

* ``check_flags`` runs first, from ``extension.configure`` before the plan: the batch and length flags upstream would stop on after Ray
  started (an assertion, vLLM refusing the first request) or take silently (a training batch larger than a step's
  samples, a response limit that leaves a prompt no room); ``warn_of_the_first_tokens_log_prob`` warns of a
  biased importance correction.
* ``check`` runs from ``extension.configure`` on every run through OPPO's CLI or upstream's patched driver,
  OPPO on or off (a missing dataset fails upstream's runs as late as OPPO's), and in ``parse_args``:
  - datasets (``--data.prompt_dataset``, ``--eval.dataset``; comma-separated lists too): a local file or folder
    exists, is not empty, and its rows parse and have ``--data.input_key`` (and ``--data.label_key`` if given),
    each of one type (a JSON, JSON lines or CSV file read through up to READ_THROUGH_BYTES, else its first
    ROWS_READ rows; a folder's first file's first row); a name that does not look local (no leading ``/``, ``.``
    or ``~``, no data-file extension) is a hub dataset and is skipped, as there is nothing to check offline;
  - the prompts read, built as upstream builds them and counted with the actor's tokenizer (where it is a local
    folder): the longest and ``--rollout.max_new_tokens`` fit ``--data.max_len``;
  - folders the run writes (``--ckpt.output_dir``, ``--ckpt.path`` when checkpoints are saved,
    ``--logger.tensorboard_dir``, ``--oppo.trace_dir``): the folder, or its first existing parent, is a writable
    folder (nothing is created);
  - models (``--actor``, ``--critic``, ``--reward.model_name_or_path``; upstream 0.11.2's reference loads the
    actor's): a local path exists and holds a ``config.json`` transformers can read; hub names are skipped. A
    local reward function or agent (``--reward.remote_url`` or ``--train.agent_func_path`` ending in ``.py``)
    exists;
  - with ``--oppo.enable`` and streaming, ``--oppo.cache_budget_gb`` holds at least one sequence's KV cache at
    ``--data.max_len`` in each streamed model (from its local ``config.json``; skipped where there is none).
* ``check_launch`` runs only when the CLI starts a run (not in ``parse_args``, which tests and the demo use on
  machines without the GPUs): the flags a run cannot start without, and the GPUs and CPUs of the placement
  (``placement``) against the Ray cluster if Ray is up, or this machine if Ray is about to start here. With
  ``RAY_ADDRESS`` the cluster is checked once Ray is up, at the first placement group (``launch.py``).
"""

import csv
import json
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from openrlhf_oppo import topology
from openrlhf_oppo.config import OPPOConfigError
from openrlhf_oppo.plan import resolve

# The file types upstream's blending_datasets loads as local files (openrlhf/datasets/utils.py).
DATA_FILES = (".json", ".jsonl", ".csv", ".parquet", ".arrow")
# Bytes read to find the first row of a .json array; a larger first row is not checked.
FIRST_ROW_BYTES = 1 << 20
# A local JSON, JSON lines or CSV file up to this size is read through, every row checked (upstream's loader fails
# on any row it cannot parse); of a larger one, the first ROWS_READ rows.
READ_THROUGH_BYTES = 64 << 20
ROWS_READ = 10000
# A folder's data files are looked for this many levels down (HF's data/train-*.parquet layouts).
DATA_FOLDER_DEPTH = 3
# The KV cache's element size: --ds.param_dtype is bf16 or fp16.
KV_BYTES = 2


def check(args, run_plan=None) -> None:
    """Every check of the files and folders the flags name; raises the first problem found. ``run_plan``: the
    run's plan (``plan.resolve``), whose streamed roles and cache budget are checked."""
    run_plan = run_plan or resolve(args)
    prompt_data = _check_datasets(args)
    _check_folders(args)
    _check_models(args)
    _check_prompt_room(args, prompt_data)
    if run_plan.enabled and run_plan.stream.roles:
        _check_cache_budget(args, run_plan)


def check_launch(args, have: Optional[Dict[str, float]] = None, where: str = "this machine") -> None:
    """What a run needs before it starts: its required flags, and the GPUs and CPUs of its placement on ``have``
    (Ray's resource totals), by default the Ray cluster if Ray is up, else this machine, where Ray will start.
    Skipped with ``RAY_ADDRESS`` and Ray not up yet: ``launch.py`` checks that cluster once Ray is up."""
    required = {
        "--actor.model_name_or_path": args.actor.model_name_or_path,
        "--data.prompt_dataset": args.data.prompt_dataset,
    }
    for flag, value in required.items():
        if not value:
            raise OPPOConfigError(f"{flag} is not given: a run needs it (a local path or a Hugging Face hub name).")
    if have is None:
        import ray

        if ray.is_initialized():
            have, where = ray.cluster_resources(), "the Ray cluster"
        elif os.environ.get("RAY_ADDRESS"):
            return
        else:
            have = local_machine()
    check_resources(args, have, where)


# -- datasets ----------------------------------------------------------------------------------------------------


@dataclass
class _Read:
    """What a data file holds, as far as it was read."""

    keys: Optional[List[str]]  # the first row's keys; [] for a file without rows; None where the format does not tell
    rows: List[dict] = field(default_factory=list)  # the rows read, in order
    complete: bool = True  # every row was read


def _check_datasets(args) -> List[_Read]:
    """Every dataset's checks; returns what was read of the prompt datasets (their prompts are measured against
    --data.max_len)."""
    keys = [("--data.input_key", args.data.input_key)]
    if args.data.label_key:
        keys.append(("--data.label_key", args.data.label_key))
    prompts = []
    for flag, value, split, split_flag in (
        ("--data.prompt_dataset", args.data.prompt_dataset, args.data.prompt_split, "--data.prompt_split"),
        ("--eval.dataset", args.eval.dataset, args.eval.split, "--eval.split"),
    ):
        for entry in (value or "").split(","):
            path = entry.split("@")[0].strip()  # upstream's "name@data_dir"
            read = _check_dataset(flag, path, keys, (split_flag, split)) if path else None
            if read is not None and flag == "--data.prompt_dataset":
                prompts.append((path, read))
    return prompts


def _looks_local(path: str, extensions: Iterable[str] = ()) -> bool:
    return path.startswith(("/", ".", "~")) or os.path.splitext(path)[1].lower() in extensions


def _check_dataset(flag: str, path: str, keys, split) -> Optional[_Read]:
    """The checks of one dataset; returns what was read of its rows, None where they are not read (a hub name, a
    folder, a loading script)."""
    local = os.path.expanduser(path)
    if not os.path.exists(local):
        if _looks_local(path, DATA_FILES + (".py",)):
            raise OPPOConfigError(
                f"{flag} {path} does not exist: give a local file or folder, or a dataset name on the Hugging Face hub."
            )
        return None  # a hub dataset: nothing to check offline
    ext = os.path.splitext(local)[1].lower()
    if ext == ".py":
        return None  # a loading script: what it yields shows only when it runs
    if os.path.isdir(local):
        _check_dataset_folder(flag, path, local, keys, split)
        return None
    if ext not in DATA_FILES:
        raise OPPOConfigError(
            f"{flag} {path} is a file that upstream cannot load: give a {', '.join(DATA_FILES)} file, a folder of "
            "them, or a folder saved with datasets' save_to_disk."
        )
    split_flag, split_name = split
    if split_name != "train":
        raise OPPOConfigError(
            f"{flag} {path} is a single file, which loads as the one split 'train', but {split_flag} is "
            f"{split_name!r}: use {split_flag} train (the default)."
        )
    return _check_file_rows(flag, path, local, keys)


def _check_file_rows(flag: str, shown: str, local: str, keys) -> _Read:
    try:
        read = _read_rows(local, _ext(local))
    except ValueError as error:  # a row that is no row
        raise OPPOConfigError(f"{flag} {shown}: {error}") from None
    _check_rows(flag, shown, read, keys)
    return read


def _check_rows(flag: str, path: str, read: _Read, keys) -> None:
    """Every row read has the keys, each key of one type (upstream's loader makes a column of each key, and fails
    on a row that does not fit it)."""
    if read.keys is None:
        return
    if not read.keys:
        raise OPPOConfigError(f"{flag} {path} is empty: it needs one prompt a row.")
    for key_flag, key in keys:
        if key not in read.keys:
            raise OPPOConfigError(
                f"{flag} {path} has no {key!r} in its first row ({key_flag}; the row's keys: {_shown(read.keys)}): "
                f"set {key_flag} to the key that holds it."
            )
    for key_flag, key in keys:
        first_type = None
        for number, row in enumerate(read.rows, 1):
            if key not in row:
                raise OPPOConfigError(
                    f"{flag} {path} has no {key!r} ({key_flag}) in row {number} (its keys: {_shown(list(row))}): "
                    "give every row that key, or drop the row."
                )
            kind = _json_kind(row[key])
            if first_type is None:
                first_type = kind, number
            elif kind not in (first_type[0], "null"):
                raise OPPOConfigError(
                    f"{flag} {path}: {key!r} is a {kind} in row {number} but a {first_type[0]} in row {first_type[1]}, "
                    "and upstream's loader makes one column of one type of it: give that key one type in every row."
                )


def _shown(keys: List[str]) -> str:
    return ", ".join(repr(k) for k in keys[:8]) + (", ..." if len(keys) > 8 else "")


def _json_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def _read_rows(path: str, ext: str) -> _Read:
    """The file's rows, all of them where it is at most READ_THROUGH_BYTES, else the first ROWS_READ. ValueError for
    a row that is not a row, naming it."""
    if os.path.getsize(path) == 0:
        return _Read([])
    limit = None if os.path.getsize(path) <= READ_THROUGH_BYTES else ROWS_READ
    if ext == ".parquet":
        return _parquet_rows(path, limit)
    if ext == ".arrow":
        return _Read(_arrow_stream_keys(path))
    if ext == ".csv":
        return _csv_rows(path, limit)
    if ext == ".json" and limit is None:
        return _json_array_rows(path)
    if ext == ".json":
        return _Read(_json_first_row_keys(path, array=True), complete=False)
    return _json_lines_rows(path, limit)


def _parquet_rows(path: str, limit: Optional[int]) -> _Read:
    import pyarrow.parquet

    try:
        metadata = pyarrow.parquet.read_metadata(path)
    except pyarrow.ArrowException as error:
        raise ValueError(f"it is not a readable parquet file ({error}).") from None
    keys = metadata.schema.to_arrow_schema().names if metadata.num_rows else []
    if limit is not None or not keys:
        return _Read(keys, complete=not keys)
    return _Read(keys, pyarrow.parquet.read_table(path).to_pylist())


def _csv_rows(path: str, limit: Optional[int]) -> _Read:
    """Upstream's CSV loader takes the first line for the header and fails on a row of another number of fields."""
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        lines = csv.reader(f)
        header = next(lines, [])
        rows = []
        for number, fields in enumerate(lines, 1):
            if limit is not None and number > limit:
                return _Read(header, rows, complete=False)
            if len(fields) != len(header):
                raise ValueError(
                    f"its row {number} (line {lines.line_num}) has {len(fields)} fields where the header has "
                    f"{len(header)}: quote the fields that hold commas."
                )
            rows.append(dict(zip(header, fields)))
    return _Read(header if rows else [], rows)


def _json_array_rows(path: str) -> _Read:
    """A .json file read whole: an array of rows, one object of columns (what it holds is its keys), or JSON
    lines."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.strip():
        return _Read([])
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        if not text.lstrip().startswith("["):
            return _json_lines_rows(path, None)  # upstream's loader reads a .json file of JSON lines too
        raise ValueError(f"it is not JSON (line {error.lineno}: {error.msg}): give one JSON array of rows.") from None
    if isinstance(data, dict):
        return _Read(list(data))
    if not isinstance(data, list):
        raise ValueError(f"it holds a JSON {type(data).__name__}, not an array of rows.")
    for number, row in enumerate(data, 1):
        if not isinstance(row, dict):
            raise ValueError(f"its row {number} is a JSON {_json_kind(row)}, not an object with named keys.")
    return _Read(list(data[0]) if data else [], data)


def _json_lines_rows(path: str, limit: Optional[int]) -> _Read:
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue  # upstream's loader skips blank lines
            if limit is not None and len(rows) == limit:
                return _Read(list(rows[0]), rows, complete=False)
            where = "first row" if not rows else f"row {len(rows) + 1} (line {line_number})"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"its {where} is not JSON ({error.msg}): give one JSON object a line.") from None
            if not isinstance(row, dict):
                raise ValueError(f"its {where} is a JSON {_json_kind(row)}, not an object with named keys.")
            rows.append(row)
    return _Read(list(rows[0]) if rows else [], rows)


def _json_first_row_keys(path: str, array: bool) -> Optional[List[str]]:
    """The first row's keys of a .json file too large to read whole: one JSON array of rows, or one object."""
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(FIRST_ROW_BYTES)
    text = head.lstrip()
    if not text:
        return []
    if text.startswith("["):
        body = text[1:].lstrip()
        if body.startswith("]"):
            return []
        try:
            row, _ = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            return None  # a first row longer than what was read
        return list(row) if isinstance(row, dict) else None
    return None  # one object of columns, longer than what was read


def _arrow_stream_keys(path: str) -> Optional[List[str]]:
    import pyarrow as pa

    try:
        with pa.memory_map(path) as source:
            reader = pa.ipc.open_stream(source)
            try:
                reader.read_next_batch()
            except StopIteration:
                return []
            return reader.schema.names
    except pa.ArrowInvalid:
        return None  # not the stream format datasets writes


def _check_dataset_folder(flag: str, path: str, local: str, keys, split) -> None:
    """A folder saved with datasets' ``save_to_disk`` (one dataset, or a dict of splits), a loading script's
    folder, or a folder of data files."""
    split_flag, split_name = split
    if os.path.exists(os.path.join(local, f"{os.path.basename(os.path.normpath(local))}.py")):
        return  # a loading script
    splits_file = os.path.join(local, "dataset_dict.json")
    if os.path.exists(splits_file):
        with open(splits_file) as f:
            splits = json.load(f).get("splits", [])
        if split_name not in splits:
            raise OPPOConfigError(
                f"{flag} {path} has the splits {', '.join(splits)}, not {split_name!r} ({split_flag}): set "
                f"{split_flag} to one of them."
            )
        local = os.path.join(local, split_name)
    info_file = os.path.join(local, "dataset_info.json")
    if os.path.exists(info_file):
        with open(info_file) as f:
            features = list(json.load(f).get("features") or {})
        _check_rows(flag, path, _Read(features or None), keys)
        return
    files = _data_files(local)
    if not files:
        raise OPPOConfigError(
            f"{flag} {path} is a folder without data files ({', '.join(DATA_FILES)}): give the folder that holds "
            "them, or a file."
        )
    _check_file_rows(flag, f"{path} ({os.path.relpath(files[0], local)})", files[0], keys)


def _data_files(folder: str) -> List[str]:
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if os.path.relpath(root, folder).count(os.sep) >= DATA_FOLDER_DEPTH:
            dirs[:] = []
        found += [os.path.join(root, name) for name in sorted(files) if _ext(name) in DATA_FILES]
    return found


def _ext(path: str) -> str:
    return os.path.splitext(path)[1].lower()


# -- the batch and the lengths ------------------------------------------------------------------------------------


def check_flags(args, train_batch_given: bool = True) -> None:
    """The batch and length flags upstream would stop on after Ray started (an assertion, vLLM refusing the first
    request) or take silently against what was asked. Runs before the plan, which builds on them.
    ``train_batch_given``: --train.batch_size was given, not upstream's default (which is warned of, not refused)."""
    rollout, train = args.rollout, args.train
    counts = {
        "--rollout.batch_size": (rollout.batch_size, "prompts a step"),
        "--rollout.n_samples_per_prompt": (rollout.n_samples_per_prompt, "responses a prompt"),
        "--rollout.micro_batch_size": (rollout.micro_batch_size, "samples a scoring forward pass"),
        "--train.batch_size": (train.batch_size, "samples an optimizer step"),
        "--train.micro_batch_size": (train.micro_batch_size, "samples a training forward pass"),
    }
    for flag, (value, what) in counts.items():
        if value < 1:
            raise OPPOConfigError(f"{flag} {value}: it counts {what}, so give 1 or more.")
    if rollout.max_new_tokens is not None and rollout.max_new_tokens < 1:
        raise OPPOConfigError(
            f"--rollout.max_new_tokens {rollout.max_new_tokens}: vLLM generates at least one token a response. Give "
            "1 or more, or leave it out (each response may then fill what --data.max_len leaves after its prompt)."
        )
    if rollout.max_new_tokens is not None and rollout.max_new_tokens >= args.data.max_len:
        raise OPPOConfigError(
            f"--rollout.max_new_tokens {rollout.max_new_tokens} leaves no room for a prompt in --data.max_len "
            f"{args.data.max_len}, which holds the prompt and the response: give --data.max_len the longest prompt "
            "more than --rollout.max_new_tokens, or lower --rollout.max_new_tokens."
        )
    samples = rollout.batch_size * rollout.n_samples_per_prompt
    if train.batch_size > samples:
        # DeepSpeed accumulates gradients over micro-batches until a training batch is full, across PPO steps.
        what = (
            f"--train.batch_size {train.batch_size} is above the samples a step makes (--rollout.batch_size "
            f"{rollout.batch_size} x --rollout.n_samples_per_prompt {rollout.n_samples_per_prompt} = {samples}): "
            f"the optimizer would step once every {-(-train.batch_size // samples)} PPO steps, on samples of as "
            f"many policies. Give --train.batch_size {samples} or a divisor of it."
        )
        if train_batch_given:
            raise OPPOConfigError(what)
        print(f"[openrlhf-oppo] warning: upstream's default {what}", flush=True)
    ranks = (
        args.actor.num_nodes * args.actor.num_gpus_per_node // args.ds.ring_attn_size // args.ds.tensor_parallel_size
    )
    if samples // rollout.micro_batch_size < ranks:
        raise OPPOConfigError(
            f"--rollout.batch_size {rollout.batch_size} x --rollout.n_samples_per_prompt "
            f"{rollout.n_samples_per_prompt} makes {samples // rollout.micro_batch_size} micro-batches of "
            f"--rollout.micro_batch_size {rollout.micro_batch_size}, fewer than the actor's {ranks} ranks, and "
            "each needs one: give more prompts a step or a smaller --rollout.micro_batch_size."
        )


def warn_of_the_first_tokens_log_prob(args) -> None:
    """OpenRLHF samples with vLLM's min_tokens=1, which masks the end of text at the first token; with the
    importance correction on, vLLM's log-prob of that token (pi_rollout) then leaves out the end of text's
    probability, and a response that ends there is never sampled, so never corrected. Patch 0015 makes it
    ``--rollout.min_new_tokens``."""
    if args.algo.advantage.is_correction_level == "off" or getattr(args.rollout, "min_new_tokens", 1) < 1:
        return
    fix = "--rollout.min_new_tokens 0" if hasattr(args.rollout, "min_new_tokens") else "patches/openrlhf/0015"
    print(
        f"[openrlhf-oppo] warning: --algo.advantage.is_correction_level {args.algo.advantage.is_correction_level} "
        "with responses of at least one token: vLLM's log-prob of the first token leaves out the end of text's "
        f"probability, so the correction is biased there and can drift the policy towards it ({fix} removes it).",
        flush=True,
    )


def _check_prompt_room(args, prompt_data: List[Tuple[str, _Read]]) -> None:
    """The longest prompt read and --rollout.max_new_tokens fit --data.max_len: upstream cuts a longer prompt from
    its left, saying so only in the engine's log. Measured with the actor's tokenizer where it is a local folder."""
    room = args.data.max_len - (args.rollout.max_new_tokens or 1)
    measured = _prompt_tokens(args, [read for _, read in prompt_data])
    if not measured:
        return
    longest, read_all = max(measured), all(read.complete for _, read in prompt_data)
    if longest <= room:
        return
    cut = sum(1 for tokens in measured if tokens > room)
    names = ",".join(path for path, _ in prompt_data)
    new = args.rollout.max_new_tokens
    response = f"--rollout.max_new_tokens {new}" if new else "a response of at least one token"
    fix = f"or lower --rollout.max_new_tokens to {args.data.max_len - longest}" if new else "or shorten the prompts"
    raise OPPOConfigError(
        f"--data.max_len {args.data.max_len} holds the prompt and the response, but the longest prompt of "
        f"--data.prompt_dataset {names} is {longest} tokens, and with {response} that makes {longest + (new or 1)}: "
        f"upstream would cut {cut} of {'its' if read_all else 'the first'} {len(measured)} prompts from the left. "
        f"Give --data.max_len {longest + (new or 1)} or more, {fix}."
    )


def _prompt_tokens(args, reads: List[_Read]) -> List[int]:
    """Each prompt read, as upstream builds it (input template or chat template), in tokens of the actor's tokenizer;
    [] where that tokenizer is not in a local folder or the prompts cannot be built."""
    rows = [row for read in reads for row in read.rows]
    local = os.path.expanduser(args.actor.model_name_or_path or "")
    if not rows or not os.path.isdir(local) or not _has_tokenizer(local):
        return []
    from openrlhf.datasets.prompts_dataset import preprocess_data
    from transformers import AutoTokenizer

    template = args.data.input_template if args.data.input_template and "{}" in args.data.input_template else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(local, trust_remote_code=True)
        chat = tokenizer.apply_chat_template if args.data.apply_chat_template else None
        prompts = [preprocess_data(row, template, args.data.input_key, None, chat)[0] for row in rows]
        return [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    except Exception:  # noqa: BLE001 - a tokenizer or template that fails here fails upstream in its own words
        return []


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, name)) for name in ("tokenizer.json", "tokenizer_config.json"))


# -- folders -----------------------------------------------------------------------------------------------------


def _written_folders(args) -> List[Tuple[str, str]]:
    folders = [("--ckpt.output_dir", args.ckpt.output_dir)]
    best_checkpoints = args.eval.dataset and args.eval.steps > 0 and args.ckpt.best_metric_key != "none"
    if args.ckpt.save_steps > 0 or best_checkpoints:
        folders.append(("--ckpt.path", args.ckpt.path))
    folders += [("--logger.tensorboard_dir", args.logger.tensorboard_dir), ("--oppo.trace_dir", args.oppo.trace_dir)]
    return [(flag, path) for flag, path in folders if path]


def _check_folders(args) -> None:
    for flag, path in _written_folders(args):
        check_writable_folder(flag, path)


def check_writable_folder(flag: str, path: str) -> None:
    """``path`` is a folder the run can write, or can be created: its first existing parent is a writable folder.
    Nothing is created here."""
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(full) and not os.path.isdir(full):
        raise OPPOConfigError(f"{flag} {path} is a file: give a folder, which the run writes into.")
    existing = full
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise OPPOConfigError(f"{flag} {path} cannot be created: {existing} is a file. Give a path under a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "it" if existing == full else existing
        raise OPPOConfigError(
            f"{flag} {path} cannot be written: {where} is not writable here. Give a folder the run can write."
        )


# -- models ------------------------------------------------------------------------------------------------------


def _model_paths(args) -> List[Tuple[str, str]]:
    paths = [("--actor.model_name_or_path", args.actor.model_name_or_path)]
    if not (args.reward.remote_url or args.train.agent_func_path):
        paths += [("--reward.model_name_or_path", path) for path in (args.reward.model_name_or_path or "").split(",")]
    if args.algo.advantage.estimator == "gae":
        paths.append(("--critic.model_name_or_path", args.critic.model_name_or_path))
    return [(flag, path.strip()) for flag, path in paths if path and path.strip()]


def _check_models(args) -> None:
    for flag, path in _model_paths(args):
        local = os.path.expanduser(path)
        if not os.path.exists(local):
            if _looks_local(path):
                raise OPPOConfigError(
                    f"{flag} {path} does not exist: give a checkpoint folder or a Hugging Face hub name."
                )
            continue  # a hub name
        if not os.path.isfile(os.path.join(local, "config.json")):
            what = "is a file" if os.path.isfile(local) else "has no config.json"
            raise OPPOConfigError(
                f"{flag} {path} {what}: give a Hugging Face checkpoint folder (config.json, weights, tokenizer) "
                "or a hub name."
            )
        _check_model_config(flag, path, os.path.join(local, "config.json"))
    if not args.reward.remote_url and not args.train.agent_func_path and not args.reward.model_name_or_path:
        raise OPPOConfigError(
            "No reward: give --reward.model_name_or_path, --reward.remote_url (a URL or a .py reward function) or "
            "--train.agent_func_path."
        )
    # A remote reward may be a local Python function (upstream loads a .py URL as one), as an agent is.
    python_files = {
        "--reward.remote_url": args.reward.remote_url,
        "--train.agent_func_path": args.train.agent_func_path,
    }
    for flag, value in python_files.items():
        # Upstream splits --reward.remote_url at commas after configure: a string here, a list in train().
        for path in value.split(",") if isinstance(value, str) else value or []:
            if path.strip().endswith(".py") and not os.path.isfile(os.path.expanduser(path.strip())):
                raise OPPOConfigError(f"{flag} {path} does not exist: give the path of the Python file.")


def _check_model_config(flag: str, path: str, config_file: str) -> None:
    """Every model actor reads the checkpoint's config.json first: a file that is not a JSON object stops them all."""
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        where = f" (line {error.lineno}: {error.msg})" if isinstance(error, json.JSONDecodeError) else ""
        raise OPPOConfigError(
            f"{flag} {path}: its config.json is not valid JSON{where}: give a checkpoint whose config.json "
            "transformers wrote (save_pretrained), or a hub name."
        ) from None
    if not isinstance(config, dict) or "model_type" not in config and "architectures" not in config:
        raise OPPOConfigError(
            f"{flag} {path}: its config.json names no model_type or architectures, which transformers needs to "
            "load it: give a checkpoint whose config.json transformers wrote (save_pretrained), or a hub name."
        )


# -- the KV cache budget -----------------------------------------------------------------------------------------


def _scorer_paths(args, roles) -> Dict[str, str]:
    """The checkpoint each streamed role scores with (upstream's defaults for the critic, the reference is the
    actor's)."""
    paths = topology.checkpoints(args)
    return {role: paths[role] for role in roles if paths.get(role)}


def kv_bytes_per_token(path: str) -> Optional[Tuple[int, str]]:
    """One token's keys and values in the model at ``path`` and how they add up, from its config.json; None where
    there is no local config with the attention's shape."""
    try:
        with open(os.path.join(os.path.expanduser(path), "config.json")) as f:
            config = json.load(f)
        layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    how = f"2 x {layers} layers x {kv_heads} KV heads x {head_dim} head dim x {KV_BYTES} bytes"
    return 2 * layers * kv_heads * head_dim * KV_BYTES, how


def _check_cache_budget(args, run_plan) -> None:
    gib = run_plan.stream.cache_budget_gb
    budget, tokens = gib * 2**30, args.data.max_len
    for role, path in _scorer_paths(args, run_plan.stream.roles).items():
        per_token = kv_bytes_per_token(path)
        if per_token is None:
            continue
        need = per_token[0] * tokens
        if budget < need:
            raise OPPOConfigError(
                f"--oppo.cache_budget_gb {gib:g} is below one sequence's KV cache in the "
                f"{role} model ({path}: {per_token[1]} x {tokens} tokens of --data.max_len = {need / 2**30:.3g} "
                "GiB): every streamed sequence would lose its cache and be scored in full when it ends. Give at "
                f"least {_round_up(need / 2**30)} GiB (default 4), or a smaller --data.max_len."
            )


def _round_up(gib: float) -> str:
    """A budget just above ``gib`` with two significant figures."""
    shown = float(f"{gib:.2g}")
    return f"{shown if shown >= gib else float(f'{gib * 1.05:.2g}'):g}"


# -- the placement -----------------------------------------------------------------------------------------------


def placement(run_topology: topology.Topology) -> List[Tuple[List[str], int]]:
    """The GPU groups the run asks Ray for: (the models and engines sharing the group, its GPUs), from the plan's
    topology (``topology.of``: upstream's ``train``, or ``placement.train`` under ``--oppo.colocate_models``)."""
    return [([SHOWN.get(role, role) for role in group.roles], group.gpus) for group in run_topology.groups]


# The models and engines by the names of their option groups, as the placement's line shows them.
SHOWN = {"policy": "actor", "reference": "ref", topology.ENGINES: "vLLM engines"}


def plural(count: float, what: str) -> str:
    return f"{count:g} {what}" + ("" if count == 1 else "s")


def local_machine() -> Dict[str, float]:
    """What a Ray started here would have: the visible CUDA devices and the CPUs."""
    import torch

    return {"GPU": torch.cuda.device_count(), "CPU": os.cpu_count() or 1}


def check_resources(args, have: Dict[str, float], where: str) -> None:
    """The placement's GPUs, and a CPU for each of them (each GPU's bundle takes one) plus one for the trainer
    actor, against ``have`` (Ray's resource totals)."""
    groups = placement(resolve(args).topology)
    gpus = sum(count for _, count in groups)
    has = f"{have.get('GPU', 0):g}"
    shown = "; ".join(f"{' + '.join(names)}: {count}" for names, count in groups)
    nodes = max(getattr(args, group).num_nodes for group in ("actor", "critic", "reward", "ref"))
    elsewhere = "start it on a Ray cluster that has them (RAY_ADDRESS)"
    if nodes > 1 and where == "this machine":
        elsewhere = f"start it on the Ray cluster of the {nodes} nodes it asks for (RAY_ADDRESS)"
    if have.get("GPU", 0) < gpus:
        raise OPPOConfigError(
            f"The placement needs {plural(gpus, 'GPU')} ({shown}) and {where} has {has}: lower the "
            "--actor/--critic/--reward/--ref.num_gpus_per_node and --vllm.num_engines counts, share GPUs "
            f"(--train.colocate_all, --oppo.colocate_models), or {elsewhere}."
        )
    if have.get("CPU", 0) < gpus + 1:
        raise OPPOConfigError(
            f"The placement needs {gpus + 1} CPUs (one for each of its {plural(gpus, 'GPU')}, one for the trainer) and "
            f"{where} has {have.get('CPU', 0):g}: give Ray more CPUs (ray start --num-cpus) or lower the GPU counts."
        )
