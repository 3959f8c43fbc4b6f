"""Version checks: the installed stack passes; anything outside the supported range stops with the range."""

import pytest

from openrlhf_oppo import compat


def test_installed_stack_is_supported():
    found = compat.check_versions()
    assert found["openrlhf"].startswith("0.11.") and found["vllm"].startswith("0.29.")


@pytest.mark.parametrize("package, version", [("openrlhf", "0.10.4"), ("openrlhf", "0.12.0"), ("vllm", "0.25.1")])
def test_unsupported_versions_fail_fast_with_the_range(monkeypatch, package, version):
    real = compat.installed_version
    monkeypatch.setattr(compat, "installed_version", lambda name: version if name == package else real(name))
    low, high = compat.SUPPORTED[package]
    with pytest.raises(compat.UnsupportedVersion, match=f"{package} >= {low}, < {high}; found {version}"):
        compat.check_versions()
