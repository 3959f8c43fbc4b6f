"""Know before you run: OPPO's and upstream async's PPO step predicted from an OpenRLHF run's own logs.

``python -m openrlhf_oppo.predict`` (``__main__.py``) reads a run (``runs.py``), takes its costs from its own
logged steps and the calibration of every upstream sync run (``costs.py``, ``calibration.json``), and simulates
each system's steps (``simulate.py``, ``model.py``); ``validate.py`` writes docs/prediction.md.
"""
