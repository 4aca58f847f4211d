"""Measurement core: step records and tag names, the noise-scale estimator, gradient-norm collection, the data-parallel reductions and the step engine every adapter shares."""
