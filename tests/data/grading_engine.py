"""What ``--train.agent_func_path`` names in the tests whose CPU engine grades its own samples.

The engine's agent executor is set by the ``grading_engine`` fixture (tests/conftest.py); upstream's checks and
the preflight only need the path to name a file.
"""
