"""Demo: the embedded byte-level corpus and the small GPT used by ``cbs-tracker demo`` and the proof experiment.

No part of the library depends on it; ``corpus.load_corpus`` and ``gpt.GPT`` are the entry points.
"""
