"""Import shim, NOT flash-attn: see tests/shims/README.md."""

from flash_attn import _missing as all_gather  # noqa: F401
