"""``GPTCalibration(frozen_microbatches=...)`` sets how many microbatch gradients the frozen noise scale takes."""

from cbs_tracker.commands.calibrate import GPTCalibration, calibrate_gpt


def _frozen(**kw):
    c = GPTCalibration(marks=(512.0,), run_tokens=2048, branch_tokens=256, seq_len=16, n_layer=1, d_model=16,
                       n_head=2, micro_sequences=2, accumulation=2, warmup_tokens=256, eval_sequences=8,
                       max_bytes=1 << 16, **kw)
    ((tokens, frozen),) = calibrate_gpt(c, log=lambda _: None, frozen_only=True)
    return tokens, frozen


def test_the_frozen_measurement_takes_the_microbatches_asked_for():
    tokens, default = _frozen()
    assert tokens >= 512 and default.microbatches == 32
    _, more = _frozen(frozen_microbatches=64)
    assert more.microbatches == 64 and more.noise_scale > 0 and more.stderr > 0
