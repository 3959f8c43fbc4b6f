"""CPU stand-ins for the GPU-only parts (DeepSpeed models, NCCL weight sync), for the tests and the CPU demo.

The trainer, the actors and the CLI never import this package.
"""
