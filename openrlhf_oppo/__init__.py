"""OPPO (arXiv 2509.25762) for OpenRLHF: intra-step streaming and inter-step overcommit for PPO."""

__version__ = "0.1.0"
