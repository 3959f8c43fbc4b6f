"""Import shim, NOT flash-attn: see tests/shims/README.md."""

from einops import rearrange  # noqa: F401

from flash_attn import _missing as index_first_axis  # noqa: F401
from flash_attn import _missing as pad_input  # noqa: F401
from flash_attn import _missing as unpad_input  # noqa: F401
