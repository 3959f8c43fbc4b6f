"""Import shim, NOT flash-attn: see tests/shims/README.md."""

from einops import rearrange  # noqa: F401  (re-exported, as flash-attn does)

from flash_attn import _missing

index_first_axis = pad_input = unpad_input = _missing
