"""``--bench.lengths_from_label``: every response exactly as long as its prompt's label says.

The benchmark's prompts carry a response length as their label (``workload.py``). ``fixed_length_params`` is the
rollout actors' sampling params hook (``extension.set_sampling_params_hook``): it makes each request decode exactly
that many tokens (``max_tokens`` = label, ``ignore_eos``), so that every system decodes the same lengths whatever
its random weights sample. The actors receive the hook pickled, by its module and name, and import this module.
"""

from copy import deepcopy


def fixed_length_params(sampling_params, label):
    """Sampling params that decode exactly ``int(label)`` tokens."""
    try:
        length = int(label)
    except (TypeError, ValueError):
        raise ValueError(
            f"--bench.lengths_from_label expects each prompt's label to be a response length, got {label!r}"
        )
    params = deepcopy(sampling_params)
    params.max_tokens = length
    params.min_tokens = min(params.min_tokens or 0, length)
    params.ignore_eos = True
    return params
