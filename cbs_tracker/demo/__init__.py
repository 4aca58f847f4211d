"""Demo: the embedded byte-level corpus and the small GPT used by ``cbs-tracker demo`` and the proof experiment."""
