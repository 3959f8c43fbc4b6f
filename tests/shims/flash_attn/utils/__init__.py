"""Import shim, NOT flash-attn: see tests/shims/README.md."""
