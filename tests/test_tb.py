"""TensorBoard adapter: tag names, values and x-axes, read back with TensorBoard's own reader."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cbs_tracker.integrations.tensorboard import (
    TAGS,
    TensorBoardLogger,
    record_scalars,
    schedule_scalars,
    schedule_step,
    seen_tag,
)
from tensorboard.backend.event_processing import event_accumulator

import cbs_tracker
from cbs_tracker.core.record import StepRecord

MICRO = 4096.0  # tokens per microbatch on one rank
DP = 2
# Two doublings: A = 1 for steps 1-4, 2 for steps 5-8, 4 for steps 9-12.
ACCUM = [1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4]
DROPPED_STEP = 6


def synthetic_run(unit: str = "tokens") -> list[StepRecord]:
    """Hand-built records of a 12-step run with two doublings.

    Values that float32 cannot hold exactly (1/3, 1e-3 ...) check the tolerance;
    the estimates start at step 3 and the controller's target at step 4, as in a
    real warm-up; step 6 is dropped (non-finite gradients).
    """
    records = []
    seen = 0.0
    for i, a in enumerate(ACCUM):
        step = i + 1
        gb = MICRO * DP * a
        seen += gb
        measured = step >= 3
        dropped = step == DROPPED_STEP
        records.append(
            StepRecord(
                step=step,
                tokens_seen=seen,
                unit=unit,
                global_batch=gb,
                micro_batch=MICRO,
                accumulation_steps=a,
                dp_degree=DP,
                grad_sq_norm=1e-3 / step if measured else None,
                trace_cov=7.0 + step / 3 if measured else None,
                noise_scale=(7.0 + step / 3) / (1e-3 / step) if measured else None,
                critical_batch=1000.0 * step + 1 / 3 if step >= 4 else None,
                lr=3e-4 * (1 + step / 7),
                step_grad_sq_norm=None if dropped or not measured else (-2e-4 if step == 5 else 1.1e-3 * step),
                step_trace_cov=None if dropped or not measured else 6.5 + step,
                dropped=dropped,
            )
        )
    return records


def read_events(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(
        str(log_dir), size_guidance={event_accumulator.SCALARS: 0}
    )
    acc.Reload()
    return {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]
    }


def f32(x: float) -> float:
    """What a float becomes after a round trip through TensorBoard's float32 simple_value."""
    return float(np.float32(x))


STEP_TAGS_TOKENS = {
    "cbs/noise_scale",
    "cbs/critical_batch",
    "cbs/grad_sq_norm",
    "cbs/trace_cov",
    "cbs/step_grad_sq_norm",
    "cbs/step_trace_cov",
    "cbs/global_batch_tokens",
    "cbs/micro_batch_tokens",
    "cbs/accumulation_steps",
    "cbs/dp_degree",
    "cbs/tokens_seen",
    "cbs/lr",
    "cbs/dropped",
    "cbs/measured",
}
SCHEDULE_TAGS_TOKENS = {
    "cbs_tokens/noise_scale",
    "cbs_tokens/critical_batch",
    "cbs_tokens/global_batch_tokens",
    "cbs_tokens/accumulation_steps",
}


def expected_points(records: list[StepRecord], unit: str) -> dict[str, list[tuple[int, float]]]:
    """The points each tag must hold, written out field by field (independent of TAGS)."""
    fields = {
        "cbs/noise_scale": "noise_scale",
        "cbs/critical_batch": "critical_batch",
        "cbs/grad_sq_norm": "grad_sq_norm",
        "cbs/trace_cov": "trace_cov",
        "cbs/step_grad_sq_norm": "step_grad_sq_norm",
        "cbs/step_trace_cov": "step_trace_cov",
        f"cbs/global_batch_{unit}": "global_batch",
        f"cbs/micro_batch_{unit}": "micro_batch",
        "cbs/accumulation_steps": "accumulation_steps",
        "cbs/dp_degree": "dp_degree",
        f"cbs/{unit}_seen": "tokens_seen",
        "cbs/lr": "lr",
        "cbs/dropped": "dropped",
        "cbs/measured": "measured",
    }
    schedule = {
        f"cbs_{unit}/noise_scale": "noise_scale",
        f"cbs_{unit}/critical_batch": "critical_batch",
        f"cbs_{unit}/global_batch_{unit}": "global_batch",
        f"cbs_{unit}/accumulation_steps": "accumulation_steps",
    }
    out: dict[str, list[tuple[int, float]]] = {}
    for tags, x_of in ((fields, lambda r: r.step), (schedule, lambda r: int(r.tokens_seen))):
        for tag, field in tags.items():
            out[tag] = [
                (x_of(r), f32(float(getattr(r, field))))
                for r in records
                if getattr(r, field) is not None
            ]
    return out


@pytest.mark.parametrize("unit", ["tokens", "samples"])
def test_event_file_holds_documented_tags_and_values(tmp_path, unit):
    records = synthetic_run(unit)
    with TensorBoardLogger(tmp_path / "run", flush_secs=1) as logger:
        for r in records:
            logger.log(r)
    got = read_events(tmp_path / "run")
    want = expected_points(records, unit)
    assert set(got) == set(want)
    if unit == "tokens":
        assert set(got) == STEP_TAGS_TOKENS | SCHEDULE_TAGS_TOKENS
    else:
        assert not any("tokens" in tag for tag in got)
        assert {"cbs/samples_seen", "cbs/global_batch_samples", "cbs_samples/noise_scale"} <= set(got)
    for tag in want:
        # Exact equality with the float32 rounding of the value: simple_value is float32.
        assert got[tag] == want[tag], tag


def test_none_values_are_not_written(tmp_path):
    records = synthetic_run()
    with TensorBoardLogger(tmp_path) as logger:
        for r in records:
            logger.log(r)
    got = read_events(tmp_path)
    assert [s for s, _ in got["cbs/noise_scale"]] == list(range(3, 13))
    assert [s for s, _ in got["cbs/critical_batch"]] == list(range(4, 13))
    assert DROPPED_STEP not in [s for s, _ in got["cbs/step_grad_sq_norm"]]
    assert dict(got["cbs/dropped"]) == {s: float(s == DROPPED_STEP) for s in range(1, 13)}
    # A negative per-step estimate is a legitimate value and is kept.
    assert dict(got["cbs/step_grad_sq_norm"])[5] == f32(-2e-4)
    # The token axis: x is the integer count of tokens seen after the step.
    assert [s for s, _ in got["cbs_tokens/global_batch_tokens"]] == [
        int(v) for v in np.cumsum([MICRO * DP * a for a in ACCUM])
    ]


def test_record_scalars_exact_dict():
    r = StepRecord(
        step=7,
        tokens_seen=123456.0,
        unit="tokens",
        global_batch=16384.0,
        micro_batch=4096.0,
        accumulation_steps=2,
        dp_degree=2,
        noise_scale=2500.0,
        lr=1e-3,
    )
    assert record_scalars(r) == {
        "cbs/noise_scale": 2500.0,
        "cbs/global_batch_tokens": 16384.0,
        "cbs/micro_batch_tokens": 4096.0,
        "cbs/accumulation_steps": 2.0,
        "cbs/dp_degree": 2.0,
        "cbs/tokens_seen": 123456.0,
        "cbs/lr": 1e-3,
        "cbs/dropped": 0.0,
        "cbs/measured": 1.0,
    }
    assert schedule_scalars(r) == {
        "cbs_tokens/noise_scale": 2500.0,
        "cbs_tokens/global_batch_tokens": 16384.0,
        "cbs_tokens/accumulation_steps": 2.0,
    }
    assert schedule_step(r) == 123456
    assert all(isinstance(v, float) for v in record_scalars(r).values())


def test_schedule_step_rounds_to_nearest():
    r = synthetic_run()[0]
    assert schedule_step(StepRecord(**{**r.__dict__, "tokens_seen": 99.6})) == 100
    assert schedule_step(StepRecord(**{**r.__dict__, "tokens_seen": 99.4})) == 99


DESIGN_DOC = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def test_design_doc_table_matches_tags():
    text = DESIGN_DOC.read_text(encoding="utf-8")
    section = text.split("\n### Tag table\n", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| (.+) \|$", section, flags=re.M)
    assert rows == [(t.tag, t.field, t.meaning) for t in TAGS]
    fields = set(StepRecord.__dataclass_fields__)
    assert {t.field for t in TAGS} <= fields
    # Every tag of the table is reachable: a fully populated record writes them all.
    full = StepRecord(
        step=1, tokens_seen=1.0, unit="tokens", global_batch=1.0, micro_batch=1.0,
        accumulation_steps=1, dp_degree=1, grad_sq_norm=1.0, trace_cov=1.0, noise_scale=1.0,
        critical_batch=1.0, lr=1.0, step_grad_sq_norm=1.0, step_trace_cov=1.0,
        noise_scale_low=1.0, noise_scale_high=1.0, scheduled_lr=1.0, lr_coupling=1.0, lr_conversions=0, kappa=0.5,
    )
    written = set(record_scalars(full)) | set(schedule_scalars(full))
    assert written == {t.tag.format(unit="tokens") for t in TAGS}


def test_seen_tag():
    assert seen_tag("tokens") == "cbs/tokens_seen"
    assert seen_tag("samples") == "cbs/samples_seen"
    with pytest.raises(ValueError, match=r"unit='bytes' is not supported; expected one of \('tokens', 'samples'\)"):
        seen_tag("bytes")


def test_bad_records_rejected():
    r = synthetic_run()[0]
    with pytest.raises(TypeError, match=r"expected a cbs_tracker.core.record.StepRecord, got dict"):
        record_scalars({"step": 1})
    bad_unit = StepRecord(**{**r.__dict__, "unit": "bytes"})
    with pytest.raises(ValueError, match=r"StepRecord\(unit='bytes'\) is not supported"):
        record_scalars(bad_unit)
    with pytest.raises(ValueError, match=r"StepRecord\(unit='bytes'\) is not supported"):
        schedule_scalars(bad_unit)
    with pytest.raises(ValueError, match=r"StepRecord\(tokens_seen=nan\) must be a finite number >= 0"):
        schedule_step(StepRecord(**{**r.__dict__, "tokens_seen": float("nan")}))
    with pytest.raises(ValueError, match=r"StepRecord\(tokens_seen=-1.0\) must be a finite number >= 0"):
        schedule_step(StepRecord(**{**r.__dict__, "tokens_seen": -1.0}))


def test_constructor_errors(tmp_path):
    with pytest.raises(TypeError, match=r"TensorBoardLogger\(log_dir=3\): expected a str or os.PathLike, got int"):
        TensorBoardLogger(3)
    with pytest.raises(TypeError, match=r"TensorBoardLogger\(flush_secs='1'\): expected a number of seconds, got str"):
        TensorBoardLogger(tmp_path, flush_secs="1")
    with pytest.raises(TypeError, match=r"TensorBoardLogger\(flush_secs=True\): expected a number of seconds, got bool"):
        TensorBoardLogger(tmp_path, flush_secs=True)
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ValueError, match=r"TensorBoardLogger\(flush_secs=.*\): expected a finite number of seconds > 0"):
            TensorBoardLogger(tmp_path, flush_secs=bad)
    with pytest.raises(TypeError, match=r"TensorBoardLogger\(rank_zero_only=1\): expected True or False, got int"):
        TensorBoardLogger(tmp_path, rank_zero_only=1)


def test_log_errors(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    with pytest.raises(TypeError, match=r"expected a cbs_tracker.core.record.StepRecord, got str"):
        logger.log("step")
    logger.close()
    logger.close()  # closing twice is allowed
    with pytest.raises(RuntimeError, match=r"TensorBoardLogger.log\(\) called after close\(\)"):
        logger.log(synthetic_run()[0])


def test_missing_tensorboard_names_the_extra(tmp_path, monkeypatch):
    # A None entry in sys.modules makes the import raise ImportError.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install cbs-tracker\[tensorboard\]"):
        TensorBoardLogger(tmp_path)


def _fake_process_group(monkeypatch, rank: int) -> None:
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank)


def test_nonzero_rank_writes_nothing(tmp_path, monkeypatch):
    _fake_process_group(monkeypatch, rank=1)
    log_dir = tmp_path / "rank1"
    with TensorBoardLogger(log_dir) as logger:
        for r in synthetic_run():
            logger.log(r)
    assert not log_dir.exists()


def test_rank_zero_writes_and_all_ranks_when_asked(tmp_path, monkeypatch):
    _fake_process_group(monkeypatch, rank=0)
    with TensorBoardLogger(tmp_path / "rank0") as logger:
        logger.log(synthetic_run()[0])
    assert "cbs/tokens_seen" in read_events(tmp_path / "rank0")

    _fake_process_group(monkeypatch, rank=1)
    with TensorBoardLogger(tmp_path / "every", rank_zero_only=False) as logger:
        logger.log(synthetic_run()[0])
    assert "cbs/tokens_seen" in read_events(tmp_path / "every")


def test_no_process_group_means_rank_zero(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    from cbs_tracker.core import distributed as cbs_dist

    assert cbs_dist.global_rank() == 0


def test_lazy_export():
    assert cbs_tracker.TensorBoardLogger is TensorBoardLogger
