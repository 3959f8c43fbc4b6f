"""Import shim, NOT flash-attn: see tests/shims/README.md. Every function here raises."""

__version__ = "0.0.0+cpu-test-shim"


def _missing(*args, **kwargs):
    raise RuntimeError(
        "flash-attn is not installed (this is the CPU test shim): use --ds.attn_implementation sdpa "
        "without --ds.packing_samples"
    )
