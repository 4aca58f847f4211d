"""A batch-size schedule in units seen, handed to any adapter in place of the controller.

:class:`BatchSchedule` holds ``(tokens, global batch)`` marks. Given to ``CBSTracker``,
``FSDPTracker``, ``CBSCallback`` or ``CBSTrainer`` as ``controller=``, it sets the
accumulation of each window from the units seen before it: the batch changes at the
first window boundary at or after each mark that the adapter can lay out (the same
place a controller's change takes effect), and everything else of a tracked run stays
as it is — the noise scale is measured and logged, the LR coupling and the LR
schedule's timing in starting-batch steps follow the batch, the state is checkpointed.

Any global batch that is a whole number of ``microbatch x data-parallel ranks`` runs
(DeepSeek-style gradual ramps, not only doublings); a mark that cannot be laid out is
refused, naming the nearest batches that can. Beside the schedule the tracker keeps
measuring: when the schedule runs above ``kappa x`` the upper end of the noise scale's
90% interval for long enough, it warns once, naming the tokens and both numbers.

Pure policy, no torch. Helpers: :meth:`BatchSchedule.ramp` (Megatron's linear ramp, or a
geometric one, over a token span), :meth:`BatchSchedule.from_plan` (a budget plan),
:meth:`BatchSchedule.from_records` / :meth:`BatchSchedule.from_tensorboard` (replay the
batches another run used).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from cbs_tracker.policy.controller import Decision
from cbs_tracker.policy.kappa import KappaSchedule, parse_kappa
from cbs_tracker.policy.ranks import RankChange, plain_number

__all__ = ["BatchSchedule"]

_TOL = 1e-9


def _number(owner: str, name: str, value: Any, *, minimum: float | None = None, positive: bool = False,
            allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}({name}={value!r}): expected a number")
    value = float(value)
    if not math.isfinite(value) or (minimum is not None and value < minimum) or (positive and value <= 0):
        allowed = "> 0" if positive else f">= {minimum:g}"
        raise ValueError(f"{owner}({name}={value!r}): must be finite and {allowed}")
    return value


class BatchSchedule:
    """The global batch as a function of the units seen: ``(tokens, batch)`` marks.

    Give it to an adapter as ``controller=``. The first window runs the adapter's
    starting layout (``accumulation_steps``); from the first window boundary at or after
    a mark, the mark's batch. Sizes are in the tracker's unit (tokens or samples).

    Args:
        marks: ``(tokens, global batch)`` pairs (or a mapping ``{tokens: batch}``), tokens
            strictly increasing once sorted, at least one. A mark at 0 tokens must be the
            starting batch (the adapter's first window); before the first mark the run
            keeps its starting batch.
        microbatch: units of one microbatch (one loader batch) on one rank. With it every
            mark is checked when the adapter is built (each batch must be a whole number of
            ``microbatch x ranks``) and the accumulation is ``batch / (microbatch x ranks)``
            whatever sizes the data really have; pass it when the units vary from batch to
            batch (tokens counted from labels). ``None`` (default): the first step's units
            per microbatch slot (``global_batch / accumulation_steps``), checked then.
        kappa: the critical batch the warning compares the schedule with is ``kappa x
            B_simple``: a number (default 0.5, the controller's), a
            :class:`~cbs_tracker.policy.kappa.KappaSchedule` or ``(tokens, kappa)`` pairs
            (a calibration's measured ``kappa``, ``Calibration.kappa_schedule()``).
        warn_after: measured steps in a row the batch must run above ``kappa x`` the upper
            end of the noise scale's 90% interval (and above the starting batch, which the
            adapter sets, not the schedule) before the warning (default 32). It also needs
            that stretch to hold ``warn_fraction`` of the units seen.
        warn_fraction: the share of the units seen so far that the stretch must hold
            (default 0.05).
        warn: ``False`` turns the warning off.
        observe_only: report what the schedule would run, change nothing.

    Raises:
        TypeError / ValueError: a bad mark or argument (the message names it).
    """

    STATE_VERSION = 1
    #: decide at every window, measured or not (a schedule does not wait for a measurement)
    every_window = True
    lr_scaling = None
    budget_tokens = None

    def __init__(
        self,
        marks: Iterable[Sequence[float]] | Mapping[float, float],
        *,
        microbatch: float | None = None,
        kappa: float | KappaSchedule | list[tuple[float, float]] = 0.5,
        warn_after: int = 32,
        warn_fraction: float = 0.05,
        warn: bool = True,
        observe_only: bool = False,
    ) -> None:
        owner = "BatchSchedule"
        self.marks = self._check_marks(marks)
        self.microbatch = _number(owner, "microbatch", microbatch, positive=True, allow_none=True)
        if isinstance(warn_after, bool) or not isinstance(warn_after, int) or warn_after < 1:
            raise ValueError(f"{owner}(warn_after={warn_after!r}): must be an integer >= 1")
        _number(owner, "warn_fraction", warn_fraction, minimum=0.0)
        if warn_fraction > 1:
            raise ValueError(f"{owner}(warn_fraction={warn_fraction!r}): must be in [0, 1]")
        for name, flag in (("warn", warn), ("observe_only", observe_only)):
            if not isinstance(flag, bool):
                raise TypeError(f"{owner}({name}={flag!r}): expected a bool")
        self._kappa_schedule, self._kappa_const = parse_kappa(kappa, owner)
        self.warn_after = warn_after
        self.warn_fraction = float(warn_fraction)
        self.warn = warn
        self.observe_only = observe_only
        #: the largest accumulation an adapter allows (an epoch's length); set by the adapter
        self.max_accumulation_steps: int | None = None
        if self.microbatch is not None:
            for tokens, batch in self.marks:
                self._check_layout(tokens, batch, self.microbatch, ranks=None)
        self._tokens = [t for t, _ in self.marks]
        self._ranks = 0  # data-parallel ranks, told by the adapter (bind)
        self._reset()

    def _reset(self) -> None:
        self._slot: float | None = None  # units per microbatch slot (microbatch x ranks)
        self._a0 = 0
        self._decided = 0  # the accumulation last decided (0: not started)
        self._last_step = -1
        self._last_tokens = 0.0
        self._above_steps = 0
        self._above_since: float | None = None  # units seen when the batch first ran above
        self._warned = False
        self._capped = False
        self._critical: float | None = None

    # ------------------------------------------------------------------ marks
    @staticmethod
    def _check_marks(marks: Any) -> tuple[tuple[float, float], ...]:
        owner = "BatchSchedule(marks=...)"
        if isinstance(marks, Mapping):
            marks = list(marks.items())
        try:
            pairs = [tuple(m) for m in marks]
        except TypeError as exc:
            raise TypeError(f"{owner}: expected (tokens, batch) pairs, got {marks!r}") from exc
        if not pairs:
            raise ValueError(f"{owner}: at least one (tokens, batch) mark is needed")
        checked = []
        for pair in pairs:
            if len(pair) != 2:
                raise TypeError(f"{owner}: {pair!r} is not a (tokens, batch) pair")
            tokens = _number(owner, "tokens", pair[0], minimum=0.0)
            batch = _number(owner, "batch", pair[1], positive=True)
            checked.append((tokens, batch))
        checked.sort()
        for (t0, _), (t1, _) in zip(checked, checked[1:]):
            if t0 == t1:
                raise ValueError(f"{owner}: two marks at tokens={t0:g}; give one batch per token count")
        return tuple(checked)  # type: ignore[arg-type]

    def batch_at(self, tokens: float) -> float | None:
        """The schedule's batch for a window that starts after ``tokens`` units (``None`` before the first mark)."""
        i = bisect.bisect_right(self._tokens, float(tokens) + _TOL * max(1.0, abs(tokens)))
        return None if i == 0 else self.marks[i - 1][1]

    @staticmethod
    def _check_layout(tokens: float, batch: float, slot: float, *, ranks: int | None,
                      hint: str = "") -> int:
        """``batch / slot`` as an integer >= 1; a batch that is not a whole number of slots is refused."""
        n = batch / slot
        whole = round(n)
        if whole >= 1 and abs(n - whole) <= 1e-6 * max(1.0, n):
            return int(whole)
        below, above = math.floor(n) * slot, math.ceil(n) * slot
        nearest = [f"{b:g}" for b in (below, above) if b > 0]
        per = (f"a microbatch of {slot:g} units on one rank" if ranks is None
               else f"microbatch x {ranks} rank(s) = {slot:g} units")
        raise ValueError(
            f"BatchSchedule: the mark ({tokens:g}, {batch:g}) cannot be laid out: a global batch must be a whole "
            f"number of {per}; the nearest feasible batches are {' and '.join(nearest)}{hint}"
        )

    def bind(self, *, owner: str, dp_degree: int, starting_accumulation: int) -> None:
        """Check the marks against the adapter's layout (called when the adapter is built).

        With ``microbatch`` known, each mark must be a whole number of ``microbatch x
        dp_degree`` and a mark at 0 tokens the starting batch.
        """
        self._ranks = int(dp_degree)
        if self.microbatch is None:
            return
        slot = self.microbatch * dp_degree
        for tokens, batch in self.marks:
            self._check_layout(tokens, batch, slot, ranks=dp_degree)
        self._check_start(slot, starting_accumulation, owner)

    def _check_start(self, slot: float, a0: int, owner: str) -> None:
        first_tokens, first_batch = self.marks[0]
        if first_tokens == 0 and abs(first_batch - a0 * slot) > 1e-6 * first_batch:
            raise ValueError(
                f"{owner}: the schedule's batch at 0 units is {first_batch:g} but the run starts at "
                f"accumulation_steps={a0} x {slot:g} units per microbatch slot = {a0 * slot:g}; build the "
                f"adapter with accumulation_steps={first_batch / slot:g} or start the marks at that batch"
            )

    @property
    def allow_shrink(self) -> bool:
        """Whether a mark lowers the batch (adapters that cannot shrink refuse such a schedule)."""
        return any(b1 < b0 for (_, b0), (_, b1) in zip(self.marks, self.marks[1:]))

    # ------------------------------------------------------------------ kappa
    @property
    def kappa(self) -> float:
        """``kappa`` in force: the constant, or the measured schedule's value at the last update."""
        if self._kappa_schedule is None:
            return self._kappa_const
        return self._kappa_schedule.value_at(self._last_tokens)

    @property
    def kappa_schedule(self) -> KappaSchedule | None:
        return self._kappa_schedule

    def set_kappa(self, kappa: float | KappaSchedule | list[tuple[float, float]]) -> None:
        self._kappa_schedule, self._kappa_const = parse_kappa(kappa, "BatchSchedule")

    def add_kappa_point(self, tokens: float, kappa: float) -> None:
        """Add a measured ``kappa`` (a calibration during the run, ``CalibrateAt``)."""
        if self._kappa_schedule is None:
            self._kappa_schedule = KappaSchedule([(tokens, kappa)])
        else:
            self._kappa_schedule.add(tokens, kappa)

    # ------------------------------------------------------------------ update
    @property
    def accumulation_steps(self) -> int:
        """The accumulation last decided (0 before the first update)."""
        return self._decided

    def update(
        self,
        *,
        step: int,
        tokens_seen: float,
        global_batch: float,
        accumulation_steps: int,
        noise_scale: float | None,
        noise_scale_low: float | None = None,
        noise_scale_high: float | None = None,
        **_: Any,
    ) -> Decision:
        """One optimizer step: the accumulation of the window that starts after ``tokens_seen`` units.

        Same arguments and result as :meth:`BatchSizeController.update
        <cbs_tracker.policy.controller.BatchSizeController.update>`; ``noise_scale`` is
        ``None`` on a window that was not measured.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step <= self._last_step:
            raise RuntimeError(f"BatchSchedule.update(step={step!r}): steps must increase (last was {self._last_step})")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"BatchSchedule.update(accumulation_steps={accumulation_steps!r}): must be an int >= 1")
        if not (math.isfinite(global_batch) and global_batch > 0):
            raise ValueError(f"BatchSchedule.update(global_batch={global_batch!r}): must be finite and > 0")
        if self._decided == 0:
            self._start(global_batch, accumulation_steps)
        self._last_step, self._last_tokens = step, float(tokens_seen)
        assert self._slot is not None
        scheduled = self.batch_at(tokens_seen)
        if scheduled is not None:
            target = self._check_layout(tokens_seen, scheduled, self._slot, ranks=None)
        else:  # the starting layout (unless a resume on more ranks made it a fraction of a microbatch)
            target = int(self._a0) if float(self._a0).is_integer() else self._decided
        reason = "schedule" if scheduled is None else f"schedule: {scheduled:g} from {self._mark_of(tokens_seen):g} units"
        cap = self.max_accumulation_steps
        if cap is not None and target > cap:
            if not self._capped:
                reason += f" (capped at accumulation {cap}: the schedule's {target} does not fit)"
            self._capped, target = True, int(cap)
        measured = noise_scale is not None and math.isfinite(noise_scale) and noise_scale > 0
        if measured:
            self._critical = self.kappa * float(noise_scale)  # type: ignore[arg-type]
        critical = self._critical  # the last measured one on a window not measured
        warning = self._check_above(float(tokens_seen), accumulation_steps * self._slot, noise_scale,
                                    noise_scale_high, measured)
        changed = target != self._decided
        self._decided = target
        return Decision(
            step=step, accumulation_steps=target, global_batch=target * self._slot, changed=changed,
            critical_batch=critical, decision_noise_scale=noise_scale if measured else None, lr_factor=1.0,
            reason=reason, planned_batch=scheduled, warning=warning,
        )

    def _start(self, global_batch: float, accumulation_steps: int) -> None:
        self._a0 = accumulation_steps
        if self.microbatch is not None:
            # the adapter's ranks (bind); else read from the step (exact with data of the nominal size)
            ranks = self._ranks or max(1, round(global_batch / accumulation_steps / self.microbatch))
            self._slot = self.microbatch * ranks
        else:
            self._slot = float(global_batch) / accumulation_steps
            hint = ("; the first step ran " f"{global_batch:g} units in {accumulation_steps} microbatch slot(s). "
                    "If the units vary from batch to batch, pass microbatch= (the nominal units of one "
                    "microbatch on one rank)")
            for tokens, batch in self.marks:
                self._check_layout(tokens, batch, self._slot, ranks=None, hint=hint)
            self._check_start(self._slot, accumulation_steps, "BatchSchedule")
        self._decided = accumulation_steps

    def _mark_of(self, tokens: float) -> float:
        i = bisect.bisect_right(self._tokens, float(tokens) + _TOL * max(1.0, abs(tokens)))
        return self._tokens[i - 1]

    def _check_above(self, tokens: float, batch: float, noise_scale: float | None, high: float | None,
                     measured: bool) -> str | None:
        """Count measured steps whose batch ran above ``kappa x`` the noise scale's upper end; the warning once."""
        if not (self.warn and measured) or high is None or not math.isfinite(high):
            return None
        bound = self.kappa * float(high)
        # the starting batch is the adapter's, not the schedule's: only a batch the schedule raised is judged
        if batch <= bound or batch <= self._a0 * (self._slot or 0.0) * (1 + 1e-9):
            self._above_steps, self._above_since = 0, None
            return None
        if self._above_since is None:
            self._above_since = tokens - batch
        self._above_steps += 1
        span = tokens - self._above_since
        if self._warned or self._above_steps < self.warn_after or span < self.warn_fraction * tokens:
            return None
        self._warned = True
        return (
            f"BatchSchedule: from {self._above_since:,.0f} to {tokens:,.0f} units ({self._above_steps} measured "
            f"steps) the schedule ran a batch of {batch:,.0f}, above kappa x B_simple, the batch the tracker's "
            f"controller would run: kappa={self.kappa:.3g} x the upper end of the noise scale's 90% interval = "
            f"{bound:,.0f} (kappa x B_simple = {self.kappa * float(noise_scale):,.0f}). "  # type: ignore[arg-type]
            "Beyond the critical batch more tokens per step save fewer steps, so the run may need more tokens "
            "for the same loss; measure_critical_batch measures how far the critical batch is from B_simple on "
            "this model (warn=False silences this)."
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The position: plain numbers and a version (the marks are configuration: build the resumed
        schedule with the same marks; a changed schedule is followed from the resume on)."""
        return {
            "version": self.STATE_VERSION,
            "slot": 0.0 if self._slot is None else self._slot,
            "start_accumulation_steps": self._a0,
            "accumulation_steps": self._decided,
            "last_step": self._last_step,
            "last_tokens": self._last_tokens,
            "above_steps": self._above_steps,
            "above_since": -1.0 if self._above_since is None else self._above_since,
            "warned": int(self._warned),
            "capped": int(self._capped),
            "kappa_points": [] if self._kappa_schedule is None else self._kappa_schedule.state_dict(),
            "marks": [[t, b] for t, b in self.marks],
        }

    def convert_ranks(self, state: Mapping[str, Any], change: RankChange, *,
                      pending: int | None = None) -> dict[str, Any]:
        """:meth:`state_dict` output of a run on ``change.old_dp`` ranks, for a run on ``change.new_dp``:
        the units per microbatch slot move by ``D' / D``, the starting accumulation by ``D / D'`` (the
        starting global batch is kept) and the accumulation decided last by ``A' / A``."""
        out = dict(state)
        if float(state.get("slot", 0.0)) > 0:
            out["slot"] = float(state["slot"]) / change.per_rank
        start = state.get("start_accumulation_steps", 0)
        if isinstance(start, (int, float)) and not isinstance(start, bool) and start > 0:
            out["start_accumulation_steps"] = plain_number(float(start) * change.per_rank)
        decided = state.get("accumulation_steps", 0)
        if isinstance(decided, int) and decided > 0:
            out["accumulation_steps"] = change.accumulation(decided) or change.new_accumulation
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; checks everything before changing anything."""
        owner = "BatchSchedule.load_state_dict"
        if not isinstance(state, Mapping):
            raise TypeError(f"{owner}: expected a mapping, got {type(state).__name__}")
        missing = [k for k in ("version", "slot", "start_accumulation_steps", "accumulation_steps", "last_step",
                               "last_tokens") if k not in state]
        if missing:
            raise KeyError(f"{owner}: missing keys {missing}")
        if state["version"] != self.STATE_VERSION:
            raise ValueError(f"{owner}: state['version']={state['version']!r}: expected {self.STATE_VERSION}")
        ints = {k: state.get(k, 0) for k in ("start_accumulation_steps", "accumulation_steps", "last_step",
                                             "above_steps", "warned", "capped")}
        for key, value in ints.items():
            if key == "start_accumulation_steps" and isinstance(value, float) and math.isfinite(value) and value > 0:
                continue  # a fraction of a microbatch per rank after a resume on more ranks
            if isinstance(value, bool) or not isinstance(value, int) or value < (-1 if key == "last_step" else 0):
                raise ValueError(f"{owner}: state[{key!r}]={value!r}: expected an integer >= 0")
        floats = {k: state.get(k, -1.0) for k in ("slot", "last_tokens", "above_since")}
        for key, value in floats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{owner}: state[{key!r}]={value!r}: expected a finite number")
        points = state.get("kappa_points") or []
        schedule = KappaSchedule(points) if points else None
        if self.microbatch is None and ints["accumulation_steps"] > 0 and floats["slot"] > 0:
            for tokens, batch in self.marks:  # the resumed schedule must lay out on the saved slot
                self._check_layout(tokens, batch, float(floats["slot"]), ranks=None)
        self._slot = float(floats["slot"]) if floats["slot"] > 0 else None
        self._a0 = ints["start_accumulation_steps"]
        self._decided = ints["accumulation_steps"]
        self._last_step = ints["last_step"]
        self._last_tokens = float(floats["last_tokens"])
        self._above_steps = ints["above_steps"]
        self._above_since = None if floats["above_since"] < 0 else float(floats["above_since"])
        self._warned, self._capped = bool(ints["warned"]), bool(ints["capped"])
        if schedule is not None:
            self._kappa_schedule = schedule

    # ------------------------------------------------------------------ helpers
    @classmethod
    def ramp(
        cls,
        start: float,
        end: float,
        *,
        over: tuple[float, float],
        step: float | None = None,
        kind: Literal["linear", "geometric"] = "linear",
        factor: float = 2.0,
        **kwargs: Any,
    ) -> BatchSchedule:
        """A ramp from batch ``start`` to ``end`` over the token span ``over = (begin, finish)``.

        ``kind="linear"`` (Megatron's ``--rampup-batch-size``, in tokens): the batch grows by
        ``step`` (default: ``start``) at evenly spaced marks, the last (``end``) at
        ``finish``. ``kind="geometric"``: it multiplies by ``factor`` at evenly spaced
        marks (``end / start`` must be a power of ``factor``). The first mark is ``(0,
        start)``. Other keyword arguments go to the constructor.

        Raises:
            ValueError: ``end < start``, a span that is not ``0 <= begin < finish``, a step
                that does not divide ``end - start``, or ``end / start`` not a power of ``factor``.
        """
        owner = "BatchSchedule.ramp"
        start_f = _number(owner, "start", start, positive=True)
        end_f = _number(owner, "end", end, positive=True)
        assert start_f is not None and end_f is not None
        if end_f < start_f:
            raise ValueError(f"{owner}(start={start!r}, end={end!r}): a ramp goes up (end >= start)")
        if not (isinstance(over, (tuple, list)) and len(over) == 2):
            raise TypeError(f"{owner}(over={over!r}): expected (begin, finish) in units")
        begin = _number(owner, "over[0]", over[0], minimum=0.0)
        finish = _number(owner, "over[1]", over[1], minimum=0.0)
        assert begin is not None and finish is not None
        if finish <= begin:
            raise ValueError(f"{owner}(over={over!r}): must be (begin, finish) with begin < finish")
        if kind == "linear":
            inc = start_f if step is None else _number(owner, "step", step, positive=True)
            assert inc is not None
            n = (end_f - start_f) / inc
            if abs(n - round(n)) > 1e-9 * max(1.0, n):
                raise ValueError(f"{owner}(step={inc:g}): must divide end - start = {end_f - start_f:g}")
            batches = [start_f + i * inc for i in range(round(n) + 1)]
        elif kind == "geometric":
            f = _number(owner, "factor", factor, positive=True)
            assert f is not None
            if f <= 1:
                raise ValueError(f"{owner}(factor={factor!r}): must be > 1")
            n = math.log(end_f / start_f) / math.log(f)
            if abs(n - round(n)) > 1e-9 * max(1.0, n):
                raise ValueError(f"{owner}(start={start!r}, end={end!r}, factor={factor!r}): end / start must be a "
                                 "power of factor")
            batches = [start_f * f**i for i in range(round(n) + 1)]
        else:
            raise ValueError(f"{owner}(kind={kind!r}): expected 'linear' or 'geometric'")
        stages = len(batches) - 1
        marks = [(0.0, batches[0])]
        for i in range(1, stages + 1):
            marks.append((begin + (finish - begin) * i / stages, batches[i]))
        return cls(marks, **kwargs)

    @classmethod
    def from_plan(cls, plan: Any, **kwargs: Any) -> BatchSchedule:
        """A budget plan (:class:`~cbs_tracker.theory.schedule.DoublingPlan`, ``BatchSizeController.build_plan()``) as marks."""
        batches, switches = list(getattr(plan, "batches", ())), list(getattr(plan, "switch_tokens", ()))
        if not batches or len(switches) != len(batches) - 1:
            raise TypeError(f"BatchSchedule.from_plan(plan={plan!r}): expected a DoublingPlan (batches, switch_tokens)")
        marks = [(0.0, float(batches[0]))] + [(float(z), float(b)) for z, b in zip(switches, batches[1:])]
        return cls(marks, **kwargs)

    @classmethod
    def from_records(cls, records: Iterable[Any], **kwargs: Any) -> BatchSchedule:
        """The batches another run used, as marks: from its ``StepRecord``\\ s (or dicts with
        ``tokens_seen``, ``global_batch``, ``accumulation_steps``, ``dp_degree``).

        A mark where the microbatches per step (``accumulation_steps x dp_degree``) changed and
        stayed (a single short window, an epoch's last, is not a change), at the units seen
        before that step; its batch is the new microbatches times the run's first units per
        microbatch, exact for data of fixed size (pass ``microbatch=`` for the new run when
        the sizes vary).
        """
        rows = [_row(r) for r in records]
        if not rows:
            raise ValueError("BatchSchedule.from_records(records=[]): no records")
        slot = rows[0]["global_batch"] / (rows[0]["accumulation_steps"] * rows[0]["dp_degree"])
        levels = [int(r["accumulation_steps"] * r["dp_degree"]) for r in rows]
        from cbs_tracker.runlog import change_indices

        marks = [(0.0, levels[0] * slot)]
        for i in change_indices(levels):
            marks.append((rows[i - 1]["tokens_seen"], levels[i] * slot))
        return cls(marks, **kwargs)

    @classmethod
    def from_tensorboard(cls, logdir: str, **kwargs: Any) -> BatchSchedule:
        """The batches a logged run used (its ``cbs/`` tags, one run folder under ``logdir``), as marks."""
        from cbs_tracker.runlog import find_batch_changes, read_cbs_scalars, run_unit

        runs = read_cbs_scalars(logdir)
        if len(runs) != 1:
            raise ValueError(f"BatchSchedule.from_tensorboard(logdir={logdir!r}): found {len(runs)} runs "
                             f"({sorted(runs)}); point it at one run's folder")
        run = next(iter(runs.values()))
        unit = run_unit(run)
        steps, batches = run[f"cbs/global_batch_{unit}"]
        accum = dict(zip(*run["cbs/accumulation_steps"]))
        dp = dict(zip(*run["cbs/dp_degree"])) if "cbs/dp_degree" in run else {}
        first = int(steps[0])
        slot = float(batches[0]) / (accum[first] * dp.get(first, 1.0))
        changes = find_batch_changes(run)
        level0 = changes[0].old_microbatches if changes else round(accum[first] * dp.get(first, 1.0))
        marks = [(0.0, level0 * slot)] + [(c.seen, c.new_microbatches * slot) for c in changes]
        return cls(marks, **kwargs)

    def __repr__(self) -> str:
        inner = ", ".join(f"({t:g}, {b:g})" for t, b in self.marks)
        return f"BatchSchedule([{inner}])"


def _row(record: Any) -> dict[str, float]:
    get = record.get if isinstance(record, Mapping) else (lambda k, d=None: getattr(record, k, d))
    row = {k: get(k) for k in ("tokens_seen", "global_batch", "accumulation_steps")}
    row["dp_degree"] = get("dp_degree", 1) or 1
    if any(v is None for v in row.values()):
        raise TypeError(f"BatchSchedule.from_records: {record!r} has no tokens_seen, global_batch and "
                        "accumulation_steps")
    return {k: float(v) for k, v in row.items()}
