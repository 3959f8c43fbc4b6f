"""Import shim, NOT flash-attn: see tests/shims/README.md."""

from flash_attn import _missing

all_gather = _missing
