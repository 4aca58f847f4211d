"""The proof and frontier engine: a small GPT trained end to end under each batch rule.

``gpt_proof`` holds the settings, data, model and one run; ``gpt_proof_lr`` the runs under
decaying learning rates that ``benchmarks/frontier.py`` schedules; ``calibrate_proof`` measures
``kappa`` with branches from a run's checkpoints; ``measured_kappa_report`` tabulates those runs.
Run them from the repository root, e.g. ``python -m benchmarks.proof.gpt_proof_lr --quick --out runs/q``.
"""
