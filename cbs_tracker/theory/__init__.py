"""Theory: the optimal batch schedule of a functional scaling law and the noisy quadratic model (NQM), exact and online.

numpy only; ``schedule.plan_doubling`` is what the budget-aware controller calls, and
``cbs-tracker plan`` / ``cbs-tracker nqm`` print the results. See ``docs/design.md`` (Theory).
"""
