"""Batch-size policy: the controller and its parts (growth rules, feedback guard, budget plan) and the learning-rate coupling."""
