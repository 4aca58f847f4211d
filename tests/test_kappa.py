"""A measured kappa: the schedule's arithmetic, the controller's state, and kappa reaching the
controller in the plain loop, Lightning and CBSTrainer (the doubling against the one computed by hand
from the logged noise scale and kappa)."""

from __future__ import annotations

import math

import pytest
import torch

from cbs_tracker import BatchSizeController, CBSTracker
from cbs_tracker.calibrate import measure_critical_batch
from cbs_tracker.policy.kappa import KappaSchedule
from tests.estimators import NoIntervalEstimator

# ---------------------------------------------------------------------------- the schedule


def test_kappa_is_linear_in_log_tokens_between_points_and_flat_outside():
    s = KappaSchedule([(4e6, 2.0), (1e6, 0.5)])  # sorted on construction
    assert s.points == [(1e6, 0.5), (4e6, 2.0)]
    assert s.value_at(0) == 0.5 and s.value_at(1e6) == 0.5 and s.value_at(1e9) == 2.0
    assert s.value_at(2e6) == pytest.approx(1.25)  # log 2M is halfway between log 1M and log 4M
    assert s.value_at(math.exp(0.25 * math.log(4) + math.log(1e6))) == pytest.approx(0.875)
    z = KappaSchedule([(0, 1.0), (100, 3.0)])  # a point at 0 tokens: linear in tokens up to the next
    assert z.value_at(1) == pytest.approx(1.02) and z.value_at(50) == pytest.approx(2.0)
    s.add(2e6, 1.0)
    assert s.value_at(2e6) == 1.0 and s.value_at(3e6) == pytest.approx(1.0 + math.log(1.5) / math.log(2))
    s.add(2e6, 1.5)  # the same tokens: replaced
    assert s.points == [(1e6, 0.5), (2e6, 1.5), (4e6, 2.0)]


@pytest.mark.parametrize("points, error, match", [
    ([], ValueError, "at least one"),
    ([(1, 0.0)], ValueError, r"kappa=0\.0: must be finite and > 0"),
    ([(-1, 1.0)], ValueError, r"tokens=-1: must be finite and >= 0"),
    ([(1, 1.0), (1, 2.0)], ValueError, "two points at tokens=1"),
    ([(1, "a")], TypeError, r"kappa='a': expected a number"),
    ([(1, 2, 3)], TypeError, "is not a \\(tokens, kappa\\) pair"),
    (5, TypeError, "expected \\(tokens, kappa\\) pairs"),
])
def test_bad_points_are_refused(points, error, match):
    with pytest.raises(error, match=match):
        KappaSchedule(points)


def test_the_controller_follows_the_schedule_and_checkpoints_measured_points():
    ctrl = BatchSizeController(kappa=[(0, 0.5), (1000, 2.0)], warmup_steps=0, warmup_tokens=0)
    assert ctrl.kappa == 0.5
    ctrl.update(step=1, tokens_seen=1000, global_batch=10, accumulation_steps=2, noise_scale=100.0)
    assert ctrl.kappa == 2.0
    d = ctrl.update(step=2, tokens_seen=1010, global_batch=10, accumulation_steps=2, noise_scale=100.0)
    assert d.critical_batch == 200.0  # 2.0 x 100
    state = ctrl.state_dict()
    assert state["kappa_points"] == [[0.0, 0.5], [1000.0, 2.0]]
    fresh = BatchSizeController()  # configured with the constant: the measured points come back
    fresh.load_state_dict(state)
    assert fresh.kappa_schedule == KappaSchedule([(0, 0.5), (1000, 2.0)]) and fresh.kappa == 2.0
    plain = BatchSizeController(kappa=0.3)
    plain.add_kappa_point(500, 1.5)
    assert plain.kappa == 1.5 and plain.state_dict()["kappa_points"] == [[500.0, 1.5]]
    plain.set_kappa(0.4)
    assert plain.kappa == 0.4 and plain.kappa_schedule is None and plain.state_dict()["kappa_points"] == []
    plain.kappa = [(10, 2.0)]  # assignment is set_kappa
    assert plain.kappa_schedule == KappaSchedule([(10, 2.0)])
    with pytest.raises(TypeError, match=r"kappa_points'\]=0: expected a list"):
        BatchSizeController().load_state_dict({**state, "kappa_points": 0})
    with pytest.raises(ValueError, match=r"kappa_points'\]=\[\[1, -2\]\]: .*kappa=-2"):
        BatchSizeController().load_state_dict({**state, "kappa_points": [[1, -2]]})


@pytest.mark.parametrize("kappa, error, match", [
    ("0.5", TypeError, r"kappa='0\.5'\): expected a number, a KappaSchedule or a list"),
    ([(0, -1.0)], ValueError, r"BatchSizeController\(kappa=\[\(0, -1\.0\)\]\): .*must be finite and > 0"),
    (0.0, ValueError, r"kappa=0\.0\): must be finite and > 0"),
])
def test_bad_kappa_is_refused(kappa, error, match):
    with pytest.raises(error, match=match):
        BatchSizeController(kappa=kappa)


# ---------------------------------------------------------------------------- by hand, per adapter
WARMUP, MARGIN = 4, 0.1


def controller(kappa) -> BatchSizeController:
    # one measurement decides (window 1, patience 1), so the doubling can be computed by hand
    return BatchSizeController(kappa=kappa, warmup_steps=WARMUP, warmup_tokens=0, patience=1, window=1,
                               cooldown_tokens=0, margin=MARGIN, feedback_guard=False, hold_on_plateau=None)


def doubling_by_hand(rows, kappa_at) -> int | None:
    """The first step whose logged noise scale times its logged kappa reaches 2B (1 + margin); the
    logged kappa must be ``kappa_at`` its tokens."""
    for step, tokens, batch, noise_scale, kappa in rows:
        assert kappa == pytest.approx(kappa_at(tokens), rel=1e-12), (step, tokens, kappa)
        if step >= WARMUP and noise_scale is not None and kappa * noise_scale >= 2 * batch * (1 + MARGIN):
            return step
    return None


def doubling_seen(records) -> int | None:
    """The first step after which the tracker's next window has more microbatches."""
    return next((r.step for r in records if r.next_accumulation_steps > r.accumulation_steps), None)


def rows_of(records):
    return [(r.step, r.tokens_seen, r.global_batch, r.noise_scale, r.kappa) for r in records]


def _plain_run(calibrate_at: int | None):
    from tests.hf_workers import regression_data

    data = regression_data(4096, sigma=0.5)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tracker = CBSTracker(model, opt, accumulation_steps=2, unit="samples", controller=controller(0.5),
                         estimator=NoIntervalEstimator(horizon_steps=5, min_steps=3))

    def loss_fn(m, batch):
        x, y = batch
        return 0.5 * (m(x).squeeze(-1) - y).pow(2).mean()

    def branch_data(r):
        d = regression_data(512, seed=100 + r)
        return ((d.x[i:i + 2], d.y[i:i + 2]) for i in range(0, 512, 2))

    held = regression_data(256, seed=99)
    records, point, pos = [], None, 0
    while len(records) < 40:
        for _ in range(tracker.accumulation_steps):
            batch = (data.x[pos:pos + 2], data.y[pos:pos + 2])
            pos += 2
            with tracker.microbatch(2):
                (loss_fn(model, batch) / tracker.accumulation_steps).backward()
        records.append(tracker.step())
        opt.step()
        opt.zero_grad()
        if len(records) == calibrate_at:
            point = measure_critical_batch(
                model, opt, tracker=tracker, loss_fn=loss_fn, data=branch_data, microbatch_size=2,
                evaluate=lambda m: float(loss_fn(m, (held.x, held.y)).detach()), branch_tokens=64,
                multiples=(1, 2, 4, 8), replicates=2, frozen_microbatches=16)
            point.apply_to(tracker.controller)
    return records, point


def test_plain_loop_a_calibration_during_the_run_changes_when_the_batch_doubles():
    constant, _ = _plain_run(None)
    calibrated, point = _plain_run(calibrate_at=3)
    assert point.kappa is not None and point.kappa != 0.5
    hand_constant = doubling_by_hand(rows_of(constant), lambda t: 0.5)
    hand_measured = doubling_by_hand(rows_of(calibrated), lambda t: 0.5 if t <= point.tokens else point.kappa)
    assert doubling_seen(constant) == hand_constant
    # here the branches put the critical batch at 4 (8 is 0.024 nats worse), below B_simple (~14):
    # kappa ~0.28 holds the batch where kappa = 0.5 doubled it
    assert doubling_seen(calibrated) == hand_measured
    assert hand_constant is not None and hand_measured != hand_constant  # the calibration moved the doubling
    assert calibrated[:3] == constant[:3]  # identical up to the calibration


# a measured kappa as calibrations give it: below B_simple at first, then far above it
SCHEDULE = KappaSchedule([(40, 0.2), (120, 4.0)])


def test_lightning_follows_a_measured_kappa(tmp_path):
    from cbs_tracker import CBSCallback
    from tests.lightning_workers import Recorder, Regression, regression_data
    from tests.test_lightning import loader, make_trainer

    seen = {}
    for name, kappa in (("constant", 0.5), ("measured", SCHEDULE)):
        cb = CBSCallback(controller=controller(kappa), estimator=NoIntervalEstimator(horizon_steps=5, min_steps=3),
                         unit="samples")
        rec = Recorder(cb)
        make_trainer(max_steps=30, accumulate_grad_batches=2, callbacks=[cb, rec]).fit(
            Regression(lr=0.05), loader(regression_data(512), 2))
        records = [type("R", (), r["record"])() for r in rec.rows]
        seen[name] = (doubling_seen(records), rows_of(records))
    assert seen["constant"][0] == doubling_by_hand(seen["constant"][1], lambda t: 0.5)
    assert seen["measured"][0] == doubling_by_hand(seen["measured"][1], SCHEDULE.value_at) is not None
    assert seen["measured"][0] != seen["constant"][0]


def test_cbstrainer_follows_a_measured_kappa(tmp_path):
    from tests.hf_workers import Regression, regression_data, training_args
    from tests.test_transformers import make

    seen = {}
    for name, kappa in (("constant", 0.5), ("measured", SCHEDULE)):
        trainer, rec = make(Regression(seed=0), training_args(str(tmp_path / name), max_steps=30),
                            regression_data(512), unit="samples", controller=controller(kappa),
                            estimator=NoIntervalEstimator(horizon_steps=5, min_steps=3))
        trainer.train()
        seen[name] = (doubling_seen(rec.rows), rows_of(rec.rows))
    assert seen["constant"][0] == doubling_by_hand(seen["constant"][1], lambda t: 0.5)
    assert seen["measured"][0] == doubling_by_hand(seen["measured"][1], SCHEDULE.value_at) is not None
    assert seen["measured"][0] != seen["constant"][0]


# ---------------------------------------------------------------------------- calibration during fit / train
def _branch_kwargs(loss_fn, column: bool):
    """Branch data of their own and a held-out set for the regression (labels as a column for Lightning's)."""
    from tests.hf_workers import regression_data

    def pair(d, i, j):
        return d.x[i:j], d.y[i:j, None] if column else d.y[i:j]

    held = regression_data(256, seed=99)

    def data(r):
        d = regression_data(256, seed=100 + r)
        return (pair(d, i, i + 2) for i in range(0, 256, 2))

    return dict(loss_fn=loss_fn, data=data, microbatch_size=2, branch_tokens=32, multiples=(1, 2, 4),
                evaluate=lambda m: float(loss_fn(m, pair(held, 0, 256)).detach()), frozen_microbatches=8)


def test_lightning_calibrates_at_a_mark_during_fit_without_touching_the_run(tmp_path):
    from cbs_tracker.integrations.lightning import CBSCalibration

    from cbs_tracker import CBSCallback
    from tests.lightning_workers import Recorder, Regression, regression_data
    from tests.test_lightning import loader, make_trainer

    def lit(m, batch):
        return m.loss(batch)

    def fit(calibrate: str | None):
        cb = CBSCallback(controller=controller(0.5), estimator=NoIntervalEstimator(horizon_steps=5, min_steps=3),
                         unit="samples")
        rec = Recorder(cb)
        extra = [] if calibrate is None else [CBSCalibration(cb, [40], apply=calibrate == "apply",
                                                             **_branch_kwargs(lit, column=True))]
        torch.manual_seed(0)
        make_trainer(max_steps=20, accumulate_grad_batches=2, callbacks=[cb, rec, *extra]).fit(
            Regression(lr=0.05), loader(regression_data(512), 2))
        return cb, [r["record"] for r in rec.rows], extra

    _, plain, _ = fit(None)
    cb, observed, (cal,) = fit("observe")
    assert observed == plain  # every record, step for step: the branches never touched the run
    (point,) = cal.calibration.points
    at = next(r for r in plain if r["tokens_seen"] >= 40)  # the first step boundary at or after the mark
    assert point.tokens == at["tokens_seen"] and point.noise_scale == at["noise_scale"]
    assert cb.controller.kappa_schedule is None  # apply=False
    cb, applied, (cal,) = fit("apply")
    point = cal.calibration.points[0]
    assert cb.controller.kappa_schedule == KappaSchedule([(point.tokens, point.kappa)])


def test_cbstrainer_calibrates_at_a_mark_during_train_without_touching_the_run(tmp_path):
    from cbs_tracker.integrations.transformers import CBSCalibration

    from tests.hf_workers import Regression, regression_data, training_args
    from tests.test_transformers import make

    def hf(m, batch):
        return m.loss(*batch)

    def train(name: str, calibrate: str | None):
        trainer, rec = make(Regression(seed=0), training_args(str(tmp_path / name), max_steps=20),
                            regression_data(512), unit="samples", controller=controller(0.5),
                            estimator=NoIntervalEstimator(horizon_steps=5, min_steps=3))
        cal = None
        if calibrate is not None:
            cal = CBSCalibration(trainer, [40], apply=calibrate == "apply", **_branch_kwargs(hf, column=False))
            trainer.add_callback(cal)
        trainer.train()
        return trainer, rec.rows, cal

    _, plain, _ = train("plain", None)
    trainer, observed, cal = train("observe", "observe")
    assert observed == plain
    (point,) = cal.calibration.points
    at = next(r for r in plain if r.tokens_seen >= 40)
    assert point.tokens == at.tokens_seen and point.noise_scale == at.noise_scale
    assert trainer.controller.kappa_schedule is None
    trainer, _, cal = train("apply", "apply")
    point = cal.calibration.points[0]
    assert trainer.controller.kappa_schedule == KappaSchedule([(point.tokens, point.kappa)])


def test_calibration_tags_are_written_at_the_points_units(tmp_path):
    from cbs_tracker.integrations.tensorboard import TensorBoardLogger

    from cbs_tracker.calibrate import calibration_scalars
    from tests.test_lightning import _read_tb

    _, point = _plain_run(calibrate_at=3)
    with TensorBoardLogger(tmp_path / "plain") as tb:
        tb.log_calibration(point)
    got = _read_tb(str(tmp_path / "plain"))
    expected = {"critical_batch_low": point.critical.low, "critical_batch_high": point.critical.high,
                "kappa": point.kappa, "noise_scale": point.noise_scale, "branch_units": point.total_branch_tokens,
                "frozen_noise_scale": point.frozen.noise_scale, "lr_control_effect": point.lr_effect}
    for name, value in expected.items():
        assert got[f"cbs_calibration/{name}"] == {int(point.tokens): pytest.approx(value, rel=1e-6)}, name
    assert set(got) == set(calibration_scalars(point))  # nothing else; no preconditioner for SGD


def test_lightning_calibration_logs_its_tags_through_the_trainers_logger(tmp_path):
    from cbs_tracker.integrations.lightning import CBSCalibration
    from lightning.pytorch.loggers import TensorBoardLogger as PLTensorBoard

    from cbs_tracker import CBSCallback
    from tests.lightning_workers import Regression, regression_data
    from tests.test_lightning import _read_tb, loader, make_trainer

    def lit(m, batch):
        return m.loss(batch)

    cb = CBSCallback(controller=controller(0.5), estimator=NoIntervalEstimator(horizon_steps=5, min_steps=3),
                     unit="samples")
    cal = CBSCalibration(cb, [40], **_branch_kwargs(lit, column=True))
    log = PLTensorBoard(tmp_path, name="run", version=0)
    make_trainer(max_steps=20, accumulate_grad_batches=2, callbacks=[cb, cal], logger=log).fit(
        Regression(lr=0.05), loader(regression_data(512), 2))
    (point,) = cal.calibration.points
    got = _read_tb(log.log_dir)
    assert got["cbs_calibration/kappa"] == {int(point.tokens): pytest.approx(point.kappa, rel=1e-6)}
    assert got["cbs_calibration/critical_batch_low"] == {int(point.tokens): point.critical.low}
