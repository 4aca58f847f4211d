"""The proof experiment: the tracker against constant batches and a hand ramp on a small GPT.

Same model, data order and token budget for every run; only the batch schedule differs.
``docs/design.md`` (The proof experiment) gives the protocol, the README the results.

    python -m benchmarks.proof.gpt_proof --out runs/proof           # everything (--only constant,hand_ramp: a part)
    python -m benchmarks.proof.gpt_proof --quick --out /tmp/proof   # tiny model and budget (smoke test)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import inspect
import json
import logging
import math
import os
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

#: the repository (this package is ``benchmarks/proof``): the docs the runs read, the root workers import from
ROOT = Path(__file__).resolve().parents[2]


def worker_command(module: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a worker process: ``python -m benchmarks.proof.<module> ...``,
    with the repository importable and one thread per process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return [sys.executable, "-m", f"benchmarks.proof.{module}", *args], env


# ---------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Setting:
    """Everything that defines the experiment (a run's result is reused only for the same setting).

    Sizes are in tokens (bytes) unless named otherwise.
    """

    name: str
    budget_tokens: int
    seq_len: int
    n_layer: int
    d_model: int
    n_head: int
    lr: float
    min_lr_ratio: float  # cosine decays to min_lr_ratio * lr
    warmup_tokens: int
    weight_decay: float
    clip: float
    micro_sequences: int  # constants and hand ramp (at most half the batch, so that A >= 2)
    tracker_micro_sequences: int  # tracker runs
    tracker_start_tokens: int
    constants: tuple[int, ...]
    ramp: tuple[tuple[int, float], ...]  # (global batch, fraction of the budget)
    eval_every_tokens: int
    eval_sequences: int
    corpus_max_bytes: int | None
    seeds: tuple[int, ...] = (0, 1)
    trace_every_tokens: int = 8192
    corpus: str = "code"  # "code": the standard library's .py files; "docs": their docstrings (English prose)
    constant_tokens: int | None = None  # the constant batch of gpt_proof_lr.py's "constant" runs (None: 512)

    def key(self) -> str:
        """A short hash of what decides how a run trains; results carry it so that settings never mix.

        The list of constants and the seeds say which runs exist, not how one trains,
        so adding a constant batch keeps the runs already done. The corpus enters only when it
        is not the default, so the settings measured before it existed keep their keys.
        """
        fields = {k: v for k, v in asdict(self).items() if k not in ("name", "constants", "seeds")}
        if fields["corpus"] == "code":
            del fields["corpus"]
        if fields["constant_tokens"] is None:
            del fields["constant_tokens"]
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


FULL = Setting(
    name="full",
    budget_tokens=5 * 2**20,
    seq_len=128,
    n_layer=2,
    d_model=128,
    n_head=4,
    lr=2e-3,
    min_lr_ratio=0.1,
    warmup_tokens=200_000,
    weight_decay=0.1,
    clip=1.0,
    micro_sequences=4,
    tracker_micro_sequences=2,
    tracker_start_tokens=512,
    constants=(256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
    ramp=((2048, 0.5), (4096, 0.25), (8192, 0.15), (16384, 0.10)),
    eval_every_tokens=131_072,
    eval_sequences=256,
    corpus_max_bytes=None,
)

QUICK = Setting(
    name="quick",
    budget_tokens=32_768,
    seq_len=32,
    n_layer=1,
    d_model=32,
    n_head=2,
    lr=2e-3,
    min_lr_ratio=0.1,
    warmup_tokens=4096,
    weight_decay=0.1,
    clip=1.0,
    micro_sequences=4,
    tracker_micro_sequences=2,
    tracker_start_tokens=128,
    constants=(128, 256, 1024),
    ramp=((256, 0.5), (512, 0.25), (1024, 0.25)),
    eval_every_tokens=8192,
    eval_sequences=16,
    corpus_max_bytes=1 << 20,
    seeds=(0,),  # one seed keeps the smoke test short; the full setting repeats runs at seed 1
    trace_every_tokens=1024,
)

#: A second setting unlike the proof: deeper and narrower, half the context, another corpus (the
#: standard library's docstrings: English prose, not code), 2M tokens. Its noise scale (about 1k
#: tokens for most of the run) is about half the proof's, so it starts at 256 tokens (2 x 128-token
#: microbatches), a quarter of it or less, as the proof's 512 is of the proof's.
PROSE = Setting(
    name="prose",
    budget_tokens=2 * 2**20,
    seq_len=64,
    n_layer=3,
    d_model=96,
    n_head=4,
    lr=2e-3,
    min_lr_ratio=0.1,
    warmup_tokens=80_000,
    weight_decay=0.1,
    clip=1.0,
    micro_sequences=4,
    tracker_micro_sequences=2,
    tracker_start_tokens=256,
    constants=(256,),
    ramp=((1024, 0.5), (2048, 0.25), (4096, 0.15), (8192, 0.10)),
    eval_every_tokens=65_536,
    eval_sequences=512,
    corpus_max_bytes=None,
    corpus="docs",
    constant_tokens=256,
)

#: A third setting unlike both, so that no growth rule is judged only on the settings that chose it: a
#: synthetic language of known structure (:func:`word_chain_corpus`: words of 2-8 letters from a
#: 512-word vocabulary, chained by a sparse random bigram table, sentences ended at random), a deeper
#: and narrower GPT (4 layers x 64), a quarter of the proof's context (32), a higher peak LR (3e-3) and
#: 128-token starting batches, 1M tokens. Its entropy rate is known exactly (``word_chain_entropy``).
SYNTH = Setting(
    name="synth",
    budget_tokens=2**20,
    seq_len=32,
    n_layer=4,
    d_model=64,
    n_head=4,
    lr=3e-3,
    min_lr_ratio=0.1,
    warmup_tokens=60_000,
    weight_decay=0.1,
    clip=1.0,
    micro_sequences=2,
    tracker_micro_sequences=2,
    tracker_start_tokens=128,
    constants=(128,),
    ramp=((512, 0.5), (1024, 0.25), (2048, 0.15), (4096, 0.10)),
    eval_every_tokens=65_536,
    eval_sequences=512,
    corpus_max_bytes=None,
    corpus="synth",
    constant_tokens=128,
)

#: A fourth setting, held out: run only after the candidate default (``kappa`` rising 0.4 -> 0.8) was chosen
#: from the other three, to judge it (and the fixed 0.4) where neither was chosen. The proof's corpus (the standard library's code) on a
#: GPT unlike the proof's: 3 layers x 80, context 48, peak LR 3e-3, 192-token starting batches, 1M tokens.
HELDOUT = Setting(
    name="heldout",
    budget_tokens=2**20,
    seq_len=48,
    n_layer=3,
    d_model=80,
    n_head=4,
    lr=3e-3,
    min_lr_ratio=0.1,
    warmup_tokens=50_000,
    weight_decay=0.1,
    clip=1.0,
    micro_sequences=2,
    tracker_micro_sequences=2,
    tracker_start_tokens=192,
    constants=(192,),
    ramp=((768, 0.5), (1536, 0.25), (3072, 0.15), (6144, 0.10)),
    eval_every_tokens=65_536,
    eval_sequences=512,
    corpus_max_bytes=None,
    constant_tokens=192,
)

#: A fifth setting, held out: defined and run only after ``convert_until=0.85`` (late halvings of the scheduled LR
#: not converted) had been chosen on the other four, to judge it where it was not chosen. The prose corpus (the
#: standard library's docstrings) on a GPT unlike prose's: 2 layers x 112, context 96, peak LR 1.5e-3,
#: 192-token starting batches of two 96-token microbatches, 1M tokens. (Its first definition, with one 192-token
#: microbatch per step, left the tracker nothing to measure, K = 1: its runs never grew and were discarded.)
WIDE = Setting(
    name="wide",
    budget_tokens=2**20,
    seq_len=96,
    n_layer=2,
    d_model=112,
    n_head=4,
    lr=1.5e-3,
    min_lr_ratio=0.1,
    warmup_tokens=40_000,
    weight_decay=0.1,
    clip=1.0,
    micro_sequences=1,
    tracker_micro_sequences=1,
    tracker_start_tokens=192,
    constants=(192,),
    ramp=((768, 0.5), (1536, 0.25), (3072, 0.15), (6144, 0.10)),
    eval_every_tokens=65_536,
    eval_sequences=512,
    corpus_max_bytes=None,
    corpus="docs",
    constant_tokens=192,
)

#: The fifth setting at twice its peak LR, added after ``wide``'s runs to ask whether the default's cost there came
#: from an LR below the constant run's best: its constant batch ended 0.043 nats lower under cosine (four seeds,
#: standard error 0.016) and 0.004 lower under WSD (0.014). Everything else is ``wide``'s; no rule was chosen on it.
WIDE_LR = replace(WIDE, name="wide_lr3", lr=3e-3)

#: A seventh setting, held out: defined before any run of the rise-gated rule (``kappa0.4+convert-until0.85+rise1.3``,
#: whose gate was read off the other six settings' noise-scale traces), to judge it and the default where neither
#: was chosen or shaped. The proof's corpus (the standard library's code) on the deepest GPT here: 6 layers x 64,
#: context 64, peak LR 2.5e-3, 256-token starting batches of two 128-token microbatches, 1M tokens.
TALL = replace(HELDOUT, name="tall", seq_len=64, n_layer=6, d_model=64, lr=2.5e-3, tracker_start_tokens=256,
               constants=(256,), ramp=((1024, 0.5), (2048, 0.25), (4096, 0.15), (8192, 0.10)), constant_tokens=256)

#: An eighth setting, held out: defined before any run of the loss-slope rule (``slope1.0+convert-until0.85``,
#: whose scale was read off the other seven settings' loss curves), to judge it and the default where neither was
#: chosen or shaped. The docstrings (as ``prose`` and ``wide``) on a 4-layer x 80 GPT at the longest context here,
#: 128 tokens, peak LR 2e-3, 256-token starting batches of two one-sequence microbatches, 1M tokens.
LONG = replace(PROSE, name="long", budget_tokens=2**20, seq_len=128, n_layer=4, d_model=80, warmup_tokens=40_000,
               micro_sequences=1, tracker_micro_sequences=1, ramp=((1024, 0.5), (2048, 0.25), (4096, 0.15),
                                                                  (8192, 0.10)))

#: A ninth setting, held out: defined before any run of the plateau rule (``kappa0.4+convert-until0.85+plateau0.15``,
#: whose quarter and threshold were read off the other eight settings' loss slopes), to judge it and the default
#: where neither was chosen or shaped. The docstrings on the narrowest GPT here, 3 layers x 48, context 80, at the
#: highest peak LR, 4e-3, 160-token starting batches of two one-sequence microbatches, 1M tokens.
NARROW = replace(WIDE, name="narrow", seq_len=80, n_layer=3, d_model=48, lr=4e-3, tracker_start_tokens=160,
                 constants=(160,), constant_tokens=160, ramp=((640, 0.5), (1280, 0.25), (2560, 0.15), (5120, 0.10)))

#: A tenth setting, held out: defined after every rule on the frontier, to judge the default and the plateau rule
#: where neither was chosen, on the smallest GPT here trained longest for its size: 1 layer x 32 (22k parameters,
#: 190 tokens each), the docstrings, context 32, peak LR 3e-3, 4M tokens from 256-token batches. Its
#: constant run (cosine, seed 0, probed before any other run) falls 0.35 nats per e-fold of tokens early and 0.15-0.25
#: after a fifth of the run, near the plateau rule's 0.15 at its verdict.
TAIL = replace(QUICK, name="tail", budget_tokens=4 * 2**20, lr=3e-3, warmup_tokens=40_000, tracker_micro_sequences=4,
               tracker_start_tokens=256, constants=(256,), constant_tokens=256,
               ramp=((1024, 0.5), (2048, 0.25), (4096, 0.15), (8192, 0.10)), eval_every_tokens=131_072,
               eval_sequences=512, corpus_max_bytes=None, corpus="docs", seeds=(0, 1, 2, 3), trace_every_tokens=8192)

#: An eleventh setting, held out: ``tail`` trained twice as long (8M tokens, 380 per parameter), defined after every
#: rule to judge the plateau option where a run's loss flattens because it is long for its model, not because it
#: sits on a plateau: ``tail``'s validation loss fell 0.15-0.19 nats per e-fold of tokens at a quarter of its run and
#: 0.04-0.16 at half, so a run twice as long reads its quarter where ``hold_on_plateau=0.15`` may hold.
TAIL_LONG = replace(TAIL, name="tail_long", budget_tokens=8 * 2**20)

#: A twelfth setting, held out: another GPT long for its size, to see whether ``tail_long``'s result (the plateau
#: option held every seed, where growth ended 0.02-0.07 nats below the constant) is that model's or the option's:
#: 1 layer x 48 on the code corpus (about 40k parameters, about 200 tokens each, 8M tokens from 256-token batches),
#: defined after ``tail_long``'s runs and before any of its own. Expected: held under WSD, likely under cosine.
TAIL_CODE = replace(TAIL, name="tail_code", budget_tokens=8 * 2**20, d_model=48, corpus="code")

#: A thirteenth setting, held out: defined before any run of the rules it judges, for the plateau option gated by
#: tokens per parameter (``tracker_library_plateau15_tpp20`` in ``gpt_proof_lr``: the option's hold applies only
#: while the run has seen fewer than 20 tokens per parameter at its verdict; the 20 is Chinchilla's compute-optimal
#: ratio, chosen before this setting's runs, not fitted). A GPT long for its size on data none of the other long runs
#: used: 2 layers x 32 on the synthetic word-chain language (35k parameters, 8.4M tokens, 240 per parameter, 60 at a
#: quarter of the run), context 32, peak LR 3e-3, 256-token batches. It judges the gate only where the option would
#: hold, so its constant run (cosine, seed 0) was probed first: on 4.2M tokens its training loss fell 0.17 nats per
#: e-fold of tokens at the verdict, over the option's 0.15 (a 1-layer GPT there 0.16), and on 8.4M 0.11, so it was
#: set to 8.4M (that probe is its constant run of seed 0).
TAIL_SYNTH = replace(TAIL, name="tail_synth", n_layer=2, corpus="synth", budget_tokens=8 * 2**20)

#: A fourteenth setting, held out: defined after every rule on the frontier and before any of its runs, to judge the
#: default, ``kappa = 0.5`` and the plateau option as the library gives it (its size gate included, which cannot act
#: here: 1M tokens is under 20 per parameter) on a GPT none of them was chosen on. The docstrings, whose GPTs at
#: context 80-128 sat on a plateau for the first quarter of their runs, on 3 layers x 64 at context 112, peak LR 2e-3,
#: 224-token starting batches of two one-sequence microbatches, 1M tokens. Whether its loss sits on a plateau was
#: not known when it was defined.
MID = replace(WIDE, name="mid", seq_len=112, n_layer=3, d_model=64, lr=2e-3, tracker_start_tokens=224, constants=(224,),
              constant_tokens=224, ramp=((896, 0.5), (1792, 0.25), (3584, 0.15), (7168, 0.10)))

#: A fifteenth setting, held out: defined after the hold on a loss plateau (with its size gate) became the library's
#: default and before any run of its own, to judge that default, the ``kappa`` rule alone and ``kappa = 0.5`` on a GPT
#: none of them was chosen on: the standard library's code (as ``full``, ``heldout`` and ``tall``) at the longest
#: context any code GPT here has, 96, on 5 layers x 48, peak LR 2e-3, 192-token starting batches of two one-sequence
#: microbatches, 1M tokens. Whether its loss sits on a plateau was not known when it was defined.
CODE96 = replace(HELDOUT, name="code96", seq_len=96, n_layer=5, d_model=48, lr=2e-3, micro_sequences=1,
                 tracker_micro_sequences=1, tracker_start_tokens=192, constants=(192,), constant_tokens=192,
                 ramp=((768, 0.5), (1536, 0.25), (3072, 0.15), (6144, 0.10)))

#: A sixteenth setting, held out: defined before any run of the rule it judges (``long_run`` in ``gpt_proof_lr``: a run
#: past 20 tokens per parameter of its model is no longer held before the plateau verdict, and ``kappa`` rises with its
#: tokens per parameter; shaped on ``tail``, ``tail_long``, ``tail_code`` and ``tail_synth``), to judge it and the
#: default on a GPT long for its size that none of them was chosen on: the standard library's code on 2 layers x 32,
#: context 64, peak LR 2.5e-3, 256-token starting batches of two 128-token microbatches, 4M tokens (about 115 per
#: parameter; 20 at a sixth of the run, before the verdict). Whether its loss sits on a plateau was not known when it
#: was defined.
DUO_CODE = replace(TAIL, name="duo_code", n_layer=2, d_model=32, seq_len=64, corpus="code", lr=2.5e-3,
                   micro_sequences=2, tracker_micro_sequences=2)

#: A seconds-long setting whose starting batch is the constant 512 of the frontier's runs (tests).
TINY = replace(QUICK, name="tiny", budget_tokens=65_536, tracker_start_tokens=512, constants=(512,),
               ramp=((1024, 0.5), (2048, 0.5)))

SETTINGS = {s.name: s for s in (FULL, QUICK, PROSE, SYNTH, HELDOUT, WIDE, WIDE_LR, TALL, LONG, NARROW, TAIL, TAIL_LONG,
                                TAIL_CODE, TAIL_SYNTH, MID, CODE96, DUO_CODE, TINY)}


def parameter_count(setting: Setting) -> int:
    """The parameters of a setting's GPT (all of them, the embeddings included, each shared one once), counted on a
    model built without drawing from torch's random generator (a run's weights stay those of its seed)."""
    import torch

    from cbs_tracker.core.engine import model_parameter_count
    from cbs_tracker.demo.gpt import GPT, GPTConfig

    config = GPTConfig(context_length=setting.seq_len, n_layer=setting.n_layer, d_model=setting.d_model,
                       n_head=setting.n_head)
    with torch.random.fork_rng(devices=[]):
        return model_parameter_count(GPT(config))  # as the tracker counts it


def load_setting_corpus(setting: Setting) -> Any:
    """The corpus a setting trains on: the standard library's code, or its docstrings."""
    from cbs_tracker.demo.corpus import load_corpus, load_docstrings

    if setting.corpus == "code":
        return load_corpus(setting.corpus_max_bytes)
    if setting.corpus == "docs":
        return load_docstrings()
    if setting.corpus == "synth":
        return word_chain_corpus()
    raise ValueError(f"Setting(corpus={setting.corpus!r}): expected 'code', 'docs' or 'synth'")


#: the word-chain language: vocabulary, successors per word, probability that a word ends its sentence
WORDS, SUCCESSORS, END_P = 512, 16, 0.1


def _word_chain_tables(seed: int = 20261205) -> tuple[list[bytes], Any, Any, Any]:
    """The language's words, each word's successors and their probabilities, and the sentence-start
    distribution (numpy's PCG64 ``random()`` stream only, so the tables are the same on every machine)."""
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(seed))
    words: list[bytes] = []
    seen: set[bytes] = set()
    while len(words) < WORDS:
        length = 2 + int(rng.random() * 7)  # 2..8 letters
        word = bytes(97 + int(rng.random() * 26) for _ in range(length))
        if word not in seen:
            seen.add(word)
            words.append(word)
    zipf = 1.0 / np.arange(1, WORDS + 1) ** 1.1
    start = zipf / zipf.sum()  # sentence starts and the pool successors are drawn from
    succ = np.empty((WORDS, SUCCESSORS), dtype=np.int64)
    probs = np.empty((WORDS, SUCCESSORS))
    cdf = np.cumsum(start)
    for w in range(WORDS):
        chosen: list[int] = []
        while len(chosen) < SUCCESSORS:
            v = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
            if v not in chosen:
                chosen.append(v)
        weights = -np.log(1.0 - rng.random(SUCCESSORS))  # Dirichlet(1): sparse-ish rows
        weights = weights ** 2  # sharper: a few likely successors per word
        succ[w], probs[w] = chosen, weights / weights.sum()
    return words, succ, probs, start


def word_chain_entropy() -> float:
    """The language's entropy rate in nats per byte: the loss no model can beat.

    Given the current word, the next (separator, word) pair has probabilities ``(1 - END_P) p(v | w)``
    (a space) and ``END_P start(v)`` (``".\n"``); letters inside a word are then determined. The rate
    is the stationary mean of that entropy over the stationary mean of bytes per word.
    """
    import numpy as np

    words, succ, probs, start = _word_chain_tables()
    transition = np.zeros((WORDS, WORDS))
    for w in range(WORDS):
        transition[w] += END_P * start
        np.add.at(transition[w], succ[w], (1 - END_P) * probs[w])
    pi = np.full(WORDS, 1.0 / WORDS)
    for _ in range(2000):
        pi = pi @ transition
    space = (1 - END_P) * probs
    ent = -(space * np.log(space)).sum(1) - (END_P * start * np.log(END_P * start)).sum()
    length = np.array([len(x) for x in words], dtype=float) + (1 - END_P) * 1 + END_P * 2
    return float(pi @ ent / (pi @ length))


@functools.lru_cache(maxsize=1)
def word_chain_corpus(num_bytes: int = 4 * 2**20, val_fraction: float = 0.01) -> Any:
    """``num_bytes`` of the word-chain language (a fixed stream: the same bytes on every machine).

    The training split and the held-out split are one continuous text cut at its last ``val_fraction``.
    """
    import numpy as np

    from cbs_tracker.demo.corpus import Corpus

    words, succ, probs, start = _word_chain_tables()
    rng = np.random.Generator(np.random.PCG64(7))
    cdfs = np.cumsum(probs, axis=1).tolist()
    start_cdf = np.cumsum(start).tolist()
    import bisect

    out = bytearray()
    w = bisect.bisect_right(start_cdf, rng.random() * start_cdf[-1])
    draws = iter(rng.random(2 * num_bytes).tolist())
    while len(out) < num_bytes:
        out += words[w]
        if next(draws) < END_P:
            out += b".\n"
            w = min(bisect.bisect_right(start_cdf, next(draws) * start_cdf[-1]), WORDS - 1)
        else:
            out += b" "
            row = cdfs[w]
            w = int(succ[w][min(bisect.bisect_right(row, next(draws) * row[-1]), SUCCESSORS - 1)])
    data = np.frombuffer(bytes(out[:num_bytes]), dtype=np.uint8)
    split = data.size - int(math.floor(val_fraction * data.size))
    data.setflags(write=False)
    return Corpus(train=data[:split], val=data[split:], num_files=0, root="synthetic word chain")

SCHEDULES = ("constant", "hand_ramp", "tracker_default", "tracker_budget")

NEAR_BEST = 0.02  # nats/byte: constants within this of the best at a stage count as tied


@dataclass(frozen=True)
class RunSpec:
    """One training run."""

    schedule: str  # one of SCHEDULES
    seed: int
    lr_schedule: str = "constant"  # "constant" (after warm-up) or "cosine"
    batch_tokens: int | None = None  # constant runs only

    @property
    def name(self) -> str:
        kind = f"constant_{self.batch_tokens}" if self.schedule == "constant" else self.schedule
        suffix = "_cosine" if self.lr_schedule == "cosine" else ""
        return f"{kind}{suffix}_seed{self.seed}"


# ---------------------------------------------------------------------------- schedules


def lr_at(setting: Setting, lr_schedule: str, tokens: float) -> float:
    """Learning rate for a step that ends at ``tokens`` seen (the step's own tokens included).

    Linear warm-up over ``warmup_tokens``, then constant, or a cosine from the peak
    to ``min_lr_ratio * lr`` at the end of the budget (both by tokens, so that every
    batch schedule gets the same learning rate at the same point of the data).
    """
    peak = setting.lr
    if tokens < setting.warmup_tokens:
        return peak * tokens / setting.warmup_tokens
    if lr_schedule == "constant":
        return peak
    span = max(setting.budget_tokens - setting.warmup_tokens, 1)
    progress = min(max((tokens - setting.warmup_tokens) / span, 0.0), 1.0)
    low = setting.min_lr_ratio * peak
    return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def ramp_batch(setting: Setting, tokens_seen: float) -> int:
    """Global batch of the hand ramp for the step that starts after ``tokens_seen`` tokens."""
    edge = 0.0
    for batch, fraction in setting.ramp:
        edge += fraction * setting.budget_tokens
        if tokens_seen < edge - 1e-6:
            return batch
    return setting.ramp[-1][0]


class HandRampController:
    """The hand ramp as the proof wrote it before ``BatchSchedule`` existed: a controller returning the
    accumulation of :func:`ramp_batch` at the tokens seen. Kept as the reference the schedule must
    reproduce (``tests/test_gpt_proof.py``, ``benchmarks/schedule_handramp.py``)."""

    observe_only = False

    def __init__(self, setting: Setting, micro_tokens: int) -> None:
        self.setting, self.micro_tokens = setting, micro_tokens

    def update(self, *, step: int, tokens_seen: float, global_batch: float, accumulation_steps: int,
               noise_scale: float | None) -> Any:
        from cbs_tracker.policy.controller import Decision

        batch = ramp_batch(self.setting, tokens_seen)
        acc = batch // self.micro_tokens
        return Decision(step=step, accumulation_steps=acc, global_batch=float(batch),
                        changed=acc != accumulation_steps, critical_batch=None, decision_noise_scale=None,
                        lr_factor=1.0, reason="hand ramp")

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def ramp_marks(setting: Setting) -> list[tuple[float, int]]:
    """The hand ramp as ``(tokens, global batch)`` marks: each batch from where the fractions before it end."""
    marks, edge = [], 0.0
    for batch, fraction in setting.ramp:
        marks.append((edge, batch))
        edge += fraction * setting.budget_tokens
    return marks


def start_and_micro(spec: RunSpec, setting: Setting) -> tuple[int, int]:
    """A run's first global batch (tokens) and its microbatch (sequences).

    Tracker runs use ``tracker_micro_sequences``; the others ``micro_sequences``, but
    at most half their batch (the 512- and 256-token constants get 256- and 128-token
    microbatches), so that every run has ``A >= 2`` and is measured.
    """
    if spec.schedule == "constant":
        start = int(spec.batch_tokens or 0)
    elif spec.schedule == "hand_ramp":
        start = ramp_batch(setting, 0)
    else:
        start = setting.tracker_start_tokens
    if spec.schedule.startswith("tracker"):
        return start, setting.tracker_micro_sequences
    return start, max(1, min(setting.micro_sequences, start // (2 * setting.seq_len)))


def budget_mode_available() -> bool:
    """Whether the installed ``BatchSizeController`` has the budget-aware mode (``budget_tokens=``)."""
    from cbs_tracker.policy.controller import BatchSizeController

    return "budget_tokens" in inspect.signature(BatchSizeController).parameters


#: the controller's defaults when these rules were named (kappa 0.5, no LR-decay conversion, no hold on a loss
#: plateau); a rule keeps them whatever the library's defaults, so its stored results keep their meaning
EARLIER_DEFAULTS: dict[str, Any] = {"kappa": 0.5, "kappa_rise": 1.0, "convert_lr_decay": False, "hold_on_plateau": None}


def make_controller(spec: RunSpec, setting: Setting, micro_tokens: int) -> Any:
    """The controller object of a run (``None`` for the constants: observe only)."""
    from cbs_tracker.policy.controller import BatchSizeController

    if spec.schedule == "constant":
        return None
    if spec.schedule == "hand_ramp":
        # the library's batch schedule in tokens (it measures and logs exactly as the tracker runs do)
        from cbs_tracker import BatchSchedule

        return BatchSchedule(ramp_marks(setting), microbatch=micro_tokens)
    if spec.schedule == "tracker_default":
        return BatchSizeController(**EARLIER_DEFAULTS)
    if spec.schedule == "tracker_budget":
        return BatchSizeController(**EARLIER_DEFAULTS, budget_tokens=setting.budget_tokens)
    raise ValueError(f"unknown schedule {spec.schedule!r}; expected one of {SCHEDULES}")


def controller_config(controller: Any) -> dict[str, Any]:
    """The public settings of a run's controller (a result is reused only while they are unchanged)."""
    if controller is None:
        return {}
    marks = getattr(controller, "marks", None)
    if marks is not None:  # a BatchSchedule: its marks and microbatch decide how the run trains
        return {"marks": [[t, b] for t, b in marks], "microbatch": controller.microbatch}
    config = {
        k: v for k, v in sorted(vars(controller).items())
        if not k.startswith("_") and (v is None or isinstance(v, (bool, int, float, str)))
    }
    plateau = getattr(controller, "plateau", None)
    if plateau is not None and plateau.active:  # the hold and its gate (absent where off: older records match)
        config["hold_on_plateau"] = plateau.below
        if plateau.tokens_per_parameter is not None:
            config["plateau_tokens_per_parameter"] = plateau.tokens_per_parameter
    kappa = getattr(controller, "kappa_start", getattr(controller, "kappa", None))  # as given, before any rise
    if isinstance(kappa, (int, float)) and getattr(controller, "kappa_schedule", None) is None:
        config["kappa"] = kappa
    if config.get("kappa_rise") == 1.0:  # a fixed kappa: how every record before the option was made
        del config["kappa_rise"]
    if config.get("convert_until") == 1.0:  # every halving converts: how every record before the option was made
        del config["convert_until"]
    if "long_run_kappa" in config and config["long_run_kappa"] is None:  # off: how every record before it was made
        del config["long_run_kappa"]
    return dict(sorted(config.items()))


@functools.lru_cache(maxsize=1)
def _library_commit() -> str | None:
    """The git commit of the checkout this script runs from, ``-dirty`` if its tree had changes (provenance).

    Read once per process, at its first call (the proof scripts call it when a run starts), so a
    commit made while a long run trains is not recorded as the run's.
    """
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                              cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


# ---------------------------------------------------------------------------- one run


def _round(x: float | None, digits: int = 5) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def train_run(spec: RunSpec, setting: Setting, out: Path) -> dict[str, Any]:
    """Train one run in this process and return its record (also written to ``runs/<name>.json``)."""
    import torch

    _library_commit()  # read now: the code this run imports, not a commit made while it trains
    from cbs_tracker.integrations.plain import CBSTracker
    from cbs_tracker.integrations.tensorboard import TensorBoardLogger

    from cbs_tracker.demo.corpus import SequenceStream, evaluate
    from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw

    torch.set_num_threads(1)
    corpus = load_setting_corpus(setting)
    start_batch, micro_seqs = start_and_micro(spec, setting)
    micro_tokens = micro_seqs * setting.seq_len
    if start_batch % micro_tokens or start_batch // micro_tokens < 2:
        raise ValueError(
            f"{spec.name}: global batch {start_batch} must be a multiple >= 2 of the microbatch {micro_tokens}"
        )

    torch.manual_seed(spec.seed)
    config = GPTConfig(
        context_length=setting.seq_len, n_layer=setting.n_layer, d_model=setting.d_model, n_head=setting.n_head
    )
    model = GPT(config)
    optimizer = make_adamw(model, setting.lr, setting.weight_decay)
    stream = SequenceStream(corpus.train, seq_len=setting.seq_len, seed=spec.seed)
    tb_dir = out / "tb" / spec.name
    cbs_logger = TensorBoardLogger(tb_dir, flush_secs=30)
    from torch.utils.tensorboard import SummaryWriter

    val_writer = SummaryWriter(log_dir=str(tb_dir), flush_secs=30)
    controller = make_controller(spec, setting, micro_tokens)
    tracker = CBSTracker(
        model,
        optimizer,
        accumulation_steps=start_batch // micro_tokens,
        controller=controller,
        logger=cbs_logger,
    )

    def run_eval() -> float:
        return evaluate(model, corpus.val, seq_len=setting.seq_len, num_sequences=setting.eval_sequences)

    evals: dict[str, list[float]] = {"step": [], "tokens": [], "val_loss": []}
    trace: dict[str, list[Any]] = {"step": [], "tokens": [], "global_batch": [], "noise_scale": [], "critical_batch": []}
    changes: list[dict[str, float]] = []

    def record_eval(step: int, tokens: float) -> float:
        loss = run_eval()
        evals["step"].append(step)
        evals["tokens"].append(tokens)
        evals["val_loss"].append(round(loss, 5))
        val_writer.add_scalar("val/loss", loss, global_step=step)
        val_writer.add_scalar("val_tokens/loss", loss, global_step=int(tokens))
        return loss

    record_eval(0, 0.0)
    train_time = 0.0
    eval_time = 0.0
    tokens = 0.0
    step = 0
    next_eval = setting.eval_every_tokens
    next_trace = 0.0
    batch = start_batch
    stopped_short = 0.0
    caught: list[str] = []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        while True:
            accumulation = tracker.accumulation_steps
            if tokens + accumulation * micro_tokens > setting.budget_tokens:
                # the next step would pass the budget: stop a little short (never beyond)
                stopped_short = setting.budget_tokens - tokens
                break
            t0 = time.perf_counter()
            lr = lr_at(setting, spec.lr_schedule, tokens + accumulation * micro_tokens)
            for group in optimizer.param_groups:
                group["lr"] = lr
            for _ in range(accumulation):
                x, y = stream.next_batch(micro_seqs)
                with tracker.microbatch(labels=y):
                    _, loss = model(x, y)
                    (loss / tracker.accumulation_steps).backward()
            record = tracker.step()
            torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            train_time += time.perf_counter() - t0
            step = record.step
            tokens = record.tokens_seen
            if record.global_batch != batch:
                changes.append({"step": step, "tokens": tokens - record.global_batch, "from": batch,
                                "to": record.global_batch})
                batch = int(record.global_batch)
            if tokens >= next_trace or step == 1:
                trace["step"].append(step)
                trace["tokens"].append(tokens)
                trace["global_batch"].append(record.global_batch)
                trace["noise_scale"].append(_round(record.noise_scale, 4))
                trace["critical_batch"].append(_round(record.critical_batch, 4))
                next_trace = (math.floor(tokens / setting.trace_every_tokens) + 1) * setting.trace_every_tokens
            if tokens >= next_eval:
                t1 = time.perf_counter()
                loss = record_eval(step, tokens)
                eval_time += time.perf_counter() - t1
                logging.info("step %d, %.0f tokens, batch %d, val loss %.4f, %.0f tokens/s, B_simple %s",
                             step, tokens, batch, loss, tokens / max(train_time, 1e-9),
                             _round(record.noise_scale, 4))
                next_eval = (math.floor(tokens / setting.eval_every_tokens) + 1) * setting.eval_every_tokens
        caught = [f"{w.category.__name__}: {w.message}" for w in warned]
    if not evals["step"] or evals["step"][-1] != step:
        record_eval(step, tokens)
    for text in caught:
        logging.warning("%s", text)
    cbs_logger.close()
    val_writer.close()
    result = {
        "name": spec.name,
        "schedule": spec.schedule,
        "seed": spec.seed,
        "lr_schedule": spec.lr_schedule,
        "batch_tokens": spec.batch_tokens,
        "start_batch_tokens": start_batch,
        "micro_batch_tokens": micro_tokens,
        "final_batch_tokens": batch,
        "final_val_loss": evals["val_loss"][-1],
        "steps": step,
        "tokens": tokens,
        "tokens_short_of_budget": stopped_short,
        "train_time_s": round(train_time, 2),
        "eval_time_s": round(eval_time, 2),
        "feedback_trap": bool(getattr(controller, "feedback_trap", False)),
        "controller_config": controller_config(controller),
        "library_commit": _library_commit(),
        "warnings": caught,
        "evals": evals,
        "trace": trace,
        "batch_changes": changes,
        "setting": setting.name,
        "setting_key": setting.key(),
    }
    (out / "runs").mkdir(parents=True, exist_ok=True)
    path = out / "runs" / f"{spec.name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
    return result


# ---------------------------------------------------------------------------- the plan


def plan_runs(setting: Setting, best_constant: int | None, *, budget_mode: bool) -> list[RunSpec]:
    """Runs in the order they start; the ones that need the best constant only once it is known."""
    s0, others = setting.seeds[0], setting.seeds[1:]
    trackers = ("tracker_default", "tracker_budget") if budget_mode else ("tracker_default",)
    # the tracker runs first: they are the result; then the sweep they are compared with
    specs = [RunSpec(t, s0) for t in trackers]
    specs += [RunSpec("constant", s0, batch_tokens=b) for b in setting.constants]
    specs += [RunSpec("hand_ramp", s0)]
    specs += [RunSpec(kind, s) for s in others for kind in ("hand_ramp", *trackers)]
    specs += [RunSpec("hand_ramp", s0, "cosine")]
    if budget_mode:
        specs += [RunSpec("tracker_budget", s0, "cosine")]
    if best_constant is not None:
        specs += [RunSpec("constant", s, batch_tokens=best_constant) for s in others]
        specs += [RunSpec("constant", s0, "cosine", batch_tokens=best_constant)]
    return specs


def _load_result(path: Path, setting: Setting) -> dict[str, Any] | None:
    """A finished run's record, or ``None`` if it is missing or was made with another setting or controller."""
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    if result.get("setting_key") != setting.key():
        return None
    spec = RunSpec(result["schedule"], result["seed"], result["lr_schedule"], result["batch_tokens"])
    _, micro_seqs = start_and_micro(spec, setting)
    expected = controller_config(make_controller(spec, setting, micro_seqs * setting.seq_len))
    return result if result.get("controller_config") == expected else None


def best_constant_of(results: dict[str, dict[str, Any]], setting: Setting) -> int | None:
    """The constant batch with the lowest final loss at the first seed (constant LR), once all ran."""
    s0 = setting.seeds[0]
    finals = {}
    for b in setting.constants:
        r = results.get(RunSpec("constant", s0, batch_tokens=b).name)
        if r is None:
            return None
        finals[b] = r["final_val_loss"]
    return min(finals, key=lambda b: finals[b])


def run_all(setting: Setting, out: Path, *, jobs: int, only: set[str] | None, force: bool,
            budget_mode: bool) -> dict[str, dict[str, Any]]:
    """Run every planned run not finished yet, ``jobs`` at a time, each in its own process."""
    results: dict[str, dict[str, Any]] = {}
    for path in sorted((out / "runs").glob("*.json")):
        r = _load_result(path, setting)
        if r is not None and not force:
            results[r["name"]] = r
    (out / "logs").mkdir(parents=True, exist_ok=True)
    started: set[str] = set(results)
    failed: set[str] = set()
    running: dict[str, tuple[subprocess.Popen[bytes], Any, float]] = {}

    def wanted(spec: RunSpec) -> bool:
        group = "cosine" if spec.lr_schedule == "cosine" else spec.schedule
        return only is None or group in only

    while True:
        best = best_constant_of(results, setting)
        todo = [s for s in plan_runs(setting, best, budget_mode=budget_mode)
                if wanted(s) and s.name not in started]
        while todo and len(running) < jobs:
            spec = todo.pop(0)
            started.add(spec.name)
            log = open(out / "logs" / f"{spec.name}.log", "wb")  # noqa: SIM115 (closed when the run ends)
            cmd, env = worker_command("gpt_proof", "--worker", json.dumps(asdict(spec)),
                                      "--setting", setting.name, "--out", str(out))
            running[spec.name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log,
                                  time.time())
            print(f"[{time.strftime('%H:%M:%S')}] start {spec.name}", flush=True)
        if not running:
            break
        time.sleep(0.2)
        for name, (proc, log, t0) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[name]
            r = _load_result(out / "runs" / f"{name}.json", setting)
            if proc.returncode != 0 or r is None:
                failed.add(name)
                print(f"[{time.strftime('%H:%M:%S')}] FAILED {name} (exit {proc.returncode}); "
                      f"see {out / 'logs' / (name + '.log')}", flush=True)
                continue
            r["wall_time_s"] = round(time.time() - t0, 1)
            (out / "runs" / f"{name}.json").write_text(json.dumps(r))
            results[name] = r
            print(f"[{time.strftime('%H:%M:%S')}] done  {name}: final val loss {r['final_val_loss']:.4f}, "
                  f"{r['steps']} steps, {r['wall_time_s']:.0f} s", flush=True)
    if failed:
        print(f"failed runs: {sorted(failed)}", file=sys.stderr)
    return results


# ---------------------------------------------------------------------------- analysis


def steps_to_reach(evals: dict[str, list[float]], target: float) -> float | None:
    """Optimizer steps at which the validation curve first reaches ``target`` (linear between evaluations)."""
    steps, losses = evals["step"], evals["val_loss"]
    for i, loss in enumerate(losses):
        if loss <= target:
            if i == 0:
                return float(steps[0])
            s0, s1, l0, l1 = steps[i - 1], steps[i], losses[i - 1], loss
            return s0 + (s1 - s0) * (l0 - target) / (l0 - l1) if l0 != l1 else float(s1)
    return None


def _interp(x: list[float], y: list[float | None], at: float) -> float | None:
    import numpy as np

    pts = [(a, b) for a, b in zip(x, y) if b is not None]
    if not pts or at < pts[0][0] or at > pts[-1][0]:
        return None
    xs, ys = zip(*pts)
    return float(np.interp(at, xs, ys))


def _median_around(trace: dict[str, list[Any]], at: float, half_width: float) -> float | None:
    import numpy as np

    vals = [v for t, v in zip(trace["tokens"], trace["noise_scale"]) if v is not None and abs(t - at) <= half_width]
    return float(np.median(vals)) if vals else None


def summarise(results: dict[str, dict[str, Any]], setting: Setting, out: Path) -> dict[str, Any]:
    """Add ``steps_to_best_constant`` to every run, build the stage comparison, write ``results.json``."""
    best = best_constant_of(results, setting)
    targets: dict[tuple[int, str], tuple[float, int]] = {}
    if best is not None:
        for r in results.values():
            if r["schedule"] == "constant" and r["batch_tokens"] == best:
                targets[(r["seed"], r["lr_schedule"])] = (r["final_val_loss"], r["steps"])
    for r in results.values():
        # at constant LR the last evaluation alone moves between neighbouring evaluations by
        # about NEAR_BEST; the mean of the last three is steadier
        r["final_val_loss_mean3"] = round(sum(r["evals"]["val_loss"][-3:]) / len(r["evals"]["val_loss"][-3:]), 5)
        target = targets.get((r["seed"], r["lr_schedule"]))
        reach = None if target is None else steps_to_reach(r["evals"], target[0])
        r["best_constant_loss"] = None if target is None else target[0]
        r["steps_to_best_constant"] = None if reach is None else int(round(reach))
        r["step_saving_vs_best_constant"] = (
            None if reach is None else round(1.0 - reach / target[1], 4)  # type: ignore[index]
        )

    # Stage by stage: the best constant batch at T tokens (constant LR after warm-up, so the
    # loss of a constant run at T is the loss of a run with budget T) against the measured noise scale.
    stages = []
    s0 = setting.seeds[0]
    consts = {b: results.get(RunSpec("constant", s0, batch_tokens=b).name) for b in setting.constants}
    consts = {b: r for b, r in consts.items() if r is not None}
    tracker_runs = [r for r in results.values() if r["schedule"].startswith("tracker") and r["lr_schedule"] == "constant"]
    if consts:
        half = 0.05 * setting.budget_tokens
        for frac in (0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0):
            at = frac * setting.budget_tokens
            losses = {b: _interp(r["evals"]["tokens"], r["evals"]["val_loss"], at) for b, r in consts.items()}
            losses = {b: v for b, v in losses.items() if v is not None}
            if not losses:
                continue
            ranked = sorted(losses, key=lambda b: losses[b])
            ns_const = {b: _median_around(r["trace"], at, half) for b, r in consts.items()}
            ns_tracker = {r["name"]: _median_around(r["trace"], at, half) for r in tracker_runs}
            stages.append({
                "tokens": at,
                "best_constant": ranked[0],
                "runner_up": ranked[1] if len(ranked) > 1 else None,
                "loss_gap_to_runner_up": round(losses[ranked[1]] - losses[ranked[0]], 4) if len(ranked) > 1 else None,
                # neighbouring evaluations of one run differ by about this much: batches this close are tied
                "near_best_constants": sorted(b for b in ranked if losses[b] <= losses[ranked[0]] + NEAR_BEST),
                "constant_losses": {str(b): round(v, 4) for b, v in losses.items()},
                "noise_scale_in_constant_runs": {str(b): _round(v, 3) for b, v in ns_const.items()},
                "noise_scale_in_tracker_runs": {k: _round(v, 3) for k, v in ns_tracker.items()},
            })

    order = {s: i for i, s in enumerate(SCHEDULES)}
    runs = sorted(results.values(), key=lambda r: (r["lr_schedule"] != "constant", order[r["schedule"]],
                                                   r["batch_tokens"] or 0, r["seed"]))
    summary = {
        "setting": asdict(setting),
        "setting_key": setting.key(),
        "best_constant_tokens": best,
        "runs": [{k: v for k, v in r.items() if k not in ("evals", "trace")} for r in runs],
        "stages": stages,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    return summary


def _fmt_tokens(n: float | None) -> str:
    if n is None:
        return "-"
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n / 2**20:g}Mi"
    return f"{n / 1024:.3g}k" if n >= 1024 else f"{n:.3g}"


def table_markdown(summary: dict[str, Any]) -> str:
    """The results table (one row per run) and the stage comparison, as Markdown."""
    lines = [
        "| run | schedule | LR | seed | final val loss | mean of last 3 evals | steps | steps to best-constant loss | tokens | train time (min) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["runs"]:
        if r["schedule"] == "constant":
            sched = f"constant {_fmt_tokens(r['batch_tokens'])}"
        elif r["schedule"] == "hand_ramp":
            sched = "2k→4k→8k→16k" if summary["setting"]["name"] == "full" else "hand ramp"
        else:
            sched = f"{_fmt_tokens(r['start_batch_tokens'])}→{_fmt_tokens(r['final_batch_tokens'])}"
        reach = r.get("steps_to_best_constant")
        saving = r.get("step_saving_vs_best_constant")
        reach_s = "not reached" if reach is None else f"{reach} ({round(-100 * saving):+d}%)"
        lines.append(
            f"| {r['name']} | {sched} | {r['lr_schedule']} | {r['seed']} | {r['final_val_loss']:.4f} "
            f"| {r['final_val_loss_mean3']:.4f} | {r['steps']} "
            f"| {reach_s} | {r['tokens']:.0f} | {r['train_time_s'] / 60:.1f} |"
        )
    if summary["stages"]:
        lines += [
            "",
            "Best constant batch at each stage (argmin of the constant runs' validation loss at T tokens) "
            "against the noise scale the tracker measured there (median over ±5% of the budget):",
            "",
            f"| tokens | best constant (gap to runner-up) | constants within {NEAR_BEST} of the best "
            "| B_simple in constant runs | B_simple in tracker runs |",
            "|---|---|---|---|---|",
        ]
        for st in summary["stages"]:
            gap = st["loss_gap_to_runner_up"]
            best = f"{_fmt_tokens(st['best_constant'])} ({gap:.3f} to {_fmt_tokens(st['runner_up'])})" if gap is not None else _fmt_tokens(st["best_constant"])
            ns_c = ", ".join(f"{_fmt_tokens(int(b))}: {_fmt_tokens(v)}" for b, v in st["noise_scale_in_constant_runs"].items() if v)
            ns_t = ", ".join(f"{k.replace('tracker_', '').replace('_seed', ' s')}: {_fmt_tokens(v)}"
                             for k, v in st["noise_scale_in_tracker_runs"].items() if v)
            near = ", ".join(_fmt_tokens(b) for b in st["near_best_constants"])
            lines.append(f"| {_fmt_tokens(st['tokens'])} | {best} | {near} | {ns_c or '-'} | {ns_t or '-'} |")
    return "\n".join(lines) + "\n"


def draw(results: dict[str, dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    """The picture: loss vs tokens, loss vs steps, schedules and noise scales vs tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setting = summary["setting"]
    s0 = setting["seeds"][0]
    runs = [r for r in results.values() if r["seed"] == s0]
    consts = sorted((r for r in runs if r["schedule"] == "constant" and r["lr_schedule"] == "constant"),
                    key=lambda r: r["batch_tokens"])
    cmap = plt.get_cmap("viridis")
    colour = {r["name"]: cmap(i / max(len(consts) - 1, 1)) for i, r in enumerate(consts)}
    special = {"hand_ramp": "black", "tracker_default": "tab:blue", "tracker_budget": "tab:red"}
    label = {"hand_ramp": "hand ramp", "tracker_default": "tracker (defaults)", "tracker_budget": "tracker (budget-aware)"}

    def style(r: dict[str, Any]) -> dict[str, Any]:
        ls = "--" if r["lr_schedule"] == "cosine" else "-"
        if r["schedule"] == "constant":
            return {"color": colour.get(r["name"], "grey"), "lw": 1.0, "ls": ls,
                    "label": f"constant {_fmt_tokens(r['batch_tokens'])}" + (" (cosine)" if ls == "--" else "")}
        return {"color": special[r["schedule"]], "lw": 1.8, "ls": ls,
                "label": label[r["schedule"]] + (" (cosine)" if ls == "--" else "")}

    shown = consts + [r for r in runs if r["schedule"] != "constant" or r["lr_schedule"] == "cosine"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
    ax_tok, ax_step, ax_sched, ax_ns = axes.ravel()
    best_loss = min((r["final_val_loss"] for r in consts), default=None)
    for r in shown:
        ev = r["evals"]
        ax_tok.plot([t / 1e6 for t in ev["tokens"][1:]], ev["val_loss"][1:], **style(r))
        ax_step.plot(ev["step"][1:], ev["val_loss"][1:], **style(r))
    lo = min(min(r["evals"]["val_loss"]) for r in shown) if shown else 1.0
    for ax in (ax_tok, ax_step):
        ax.set_ylim(lo - 0.03, lo + 0.75)
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
        if best_loss is not None:
            ax.axhline(best_loss, color="grey", lw=0.8, ls=":")
    ax_tok.set_xlabel("tokens (M)")
    ax_tok.set_title(f"validation loss vs tokens (seed {s0}; dotted: best constant's final loss)")
    ax_tok.legend(fontsize=7, ncol=2, loc="upper right", framealpha=0.85)
    ax_step.set_xscale("log")
    ax_step.set_xlabel("optimizer steps")
    ax_step.set_title("validation loss vs optimizer steps")

    for r in runs:
        if r["schedule"] == "constant" or r["lr_schedule"] != "constant":
            continue
        tr = r["trace"]
        st = style(r)
        ax_sched.step([t / 1e6 for t in tr["tokens"]], tr["global_batch"], where="pre", color=st["color"],
                      lw=2.2, label=f"{st['label']}: global batch")
        ns = [(t / 1e6, v) for t, v in zip(tr["tokens"], tr["noise_scale"]) if v]
        if ns and r["schedule"] != "hand_ramp":
            ax_sched.plot(*zip(*ns), color=st["color"], lw=0.8, alpha=0.6, label=f"{st['label']}: measured B_simple")
    for ax in (ax_sched, ax_ns):
        stages = summary["stages"]
        if stages:
            xs = [s["tokens"] / 1e6 for s in stages]
            ax.vlines(xs, [min(s["near_best_constants"]) for s in stages], [max(s["near_best_constants"]) for s in stages],
                      color="orange", lw=5, alpha=0.5, label=f"constants within {NEAR_BEST} of the best there")
            ax.plot(xs, [s["best_constant"] for s in stages], "o", color="orange",
                    ms=7, mec="k", label="best constant batch at that point (sweep)", zorder=5)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("tokens (M)")
        ax.set_ylabel("tokens")
        ax.grid(alpha=0.3, which="both")
    ax_sched.set_title("batch schedules and the tracker's measured noise scale")
    ax_sched.legend(fontsize=7)
    for r in consts:
        tr = r["trace"]
        ns = [(t / 1e6, v) for t, v in zip(tr["tokens"], tr["noise_scale"]) if v]
        if ns:
            ax_ns.plot(*zip(*ns), color=colour[r["name"]], lw=0.9, label=f"B_simple measured at constant {_fmt_tokens(r['batch_tokens'])}")
    ax_ns.set_title("noise scale measured in the constant-batch runs")
    ax_ns.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/proof", help="output folder (default runs/proof)")
    p.add_argument("--quick", action="store_true", help="tiny model and budget: a smoke test")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one torch thread each; default 2)")
    p.add_argument("--only", default=None,
                   help=f"comma-separated schedules to run now ({', '.join(SCHEDULES)}, cosine); default all")
    p.add_argument("--force", action="store_true", help="rerun runs that already have results")
    p.add_argument("--report-only", action="store_true", help="run nothing; rebuild the table, JSON and PNG")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--setting", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    if args.worker is not None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        spec = RunSpec(**json.loads(args.worker))
        r = train_run(spec, SETTINGS[args.setting], out)
        print(f"{spec.name}: final val loss {r['final_val_loss']:.4f} after {r['steps']} steps, {r['tokens']:.0f} tokens")
        return 0
    setting = QUICK if args.quick else FULL
    if args.jobs < 1:
        print(f"--jobs={args.jobs}: must be >= 1", file=sys.stderr)
        return 2
    only = None if args.only is None else {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = (only or set()) - set(SCHEDULES) - {"cosine"}
    if unknown:
        print(f"--only: unknown {sorted(unknown)}; expected some of {list(SCHEDULES) + ['cosine']}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    budget_mode = budget_mode_available()
    if not budget_mode:
        print("note: this cbs_tracker has no budget-aware controller mode (BatchSizeController(budget_tokens=)); "
              "the tracker_budget runs are skipped", file=sys.stderr)
    t0 = time.time()
    if args.report_only:
        results = {}
        for path in sorted((out / "runs").glob("*.json")):
            r = _load_result(path, setting)
            if r is not None:
                results[r["name"]] = r
    else:
        results = run_all(setting, out, jobs=args.jobs, only=only, force=args.force, budget_mode=budget_mode)
    if not results:
        print("no results", file=sys.stderr)
        return 1
    summary = summarise(results, setting, out)
    table = table_markdown(summary)
    (out / "table.md").write_text(table)
    draw(results, summary, out / "proof.png")
    print(table)
    print(f"setting {setting.name} ({setting.key()}), budget {setting.budget_tokens} tokens; "
          f"wrote {out / 'results.json'}, {out / 'table.md'}, {out / 'proof.png'}, {out / 'tb'}/ "
          f"in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
