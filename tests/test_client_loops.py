"""The loops people copy: transformers' ``run_clm_no_trainer.py`` (Accelerate) and LitGPT's ``pretrain.py``
(Fabric), written here in their shapes with their own arithmetic, the batch growing under a ``BatchSchedule``.

Each silent way such a loop leaves the plan is either made right by the line the README gives, or warned
about once, naming that line:

* ``run_clm``'s stop ``completed_steps >= max_train_steps`` counts optimizer steps: after growth it trains
  past the data the scheduler was sized for (``get_scheduler``'s ``num_training_steps``), and a cosine rises
  again. ``tracker.done(max_train_steps)`` ends on the constant run's data and LR.
* ``--resume_from_checkpoint``'s ``resume_step = step * gradient_accumulation_steps`` is not the data
  position after growth; ``divmod(tracker.resume_position(), len(train_dataloader))`` is, and the resumed run
  is the uninterrupted one.
* ``--checkpointing_steps epoch`` saves where the epoch ends, inside a window; the epoch arithmetic of the
  resume then drops that window's first microbatches. The tracker's position runs them again.
* a run that ends inside a window leaves microbatches without an optimizer step.
* LitGPT's ``iter_num`` and ``max_iters`` count microbatches: ``tracker.microbatches_seen`` and
  ``tracker.done(microbatches=max_iters)`` keep its schedule and stop on the data; LitGPT's own assignment
  of the LR after growth is warned about, naming that clock.

Truths: the same loop at a constant batch (no controller), and the uninterrupted run.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from cbs_tracker import BatchSchedule, CBSTracker  # noqa: E402
from tests import accelerate_workers as aw  # noqa: E402

VOCAB, T, ROWS, A0 = 16, 9, 2, 2
MICRO = ROWS * (T - 1)  # label tokens of a microbatch (labels[..., 1:])
# 32-token steps, then 64 from 160 tokens and 128 from 480: accumulation 2 -> 4 -> 8
SCHEDULE = ((0, 2 * MICRO), (160, 4 * MICRO), (480, 8 * MICRO))


class TinyLM(nn.Module):
    """A causal LM the Hugging Face way: ``model(input_ids=..., labels=...).loss`` shifts the labels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 8, dtype=torch.float64)
        self.head = nn.Linear(8, VOCAB, dtype=torch.float64)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.head(self.emb(input_ids))
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return type("Output", (), {"loss": loss})()


class Blocks(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (n, T), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.fixture(autouse=True)
def _clean():
    yield
    aw.reset_accelerate()


def _clm_parts(batches: int, max_train_steps: int, *, grow: bool = True, shuffle: bool = False,
               seedable: bool = False, controller: Any = None) -> dict[str, Any]:
    """run_clm_no_trainer's setup: prepare, get_scheduler("cosine") sized in optimizer steps, the tracker.
    ``shuffle``: the script's ``shuffle=True`` loader; ``seedable``: ``use_seedable_sampler=True``;
    ``controller``: in place of the ``BatchSchedule``."""
    from accelerate.utils import DataLoaderConfiguration
    from cbs_tracker.integrations.accelerate import AcceleratorTracker
    from transformers import get_scheduler

    acc = aw.make_accelerator(1, gradient_accumulation_steps=A0,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable))
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(Blocks(batches * ROWS), batch_size=ROWS, shuffle=shuffle)
    lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=2,
                                 num_training_steps=max_train_steps * acc.num_processes)
    model, optimizer, loader, lr_scheduler = acc.prepare(model, optimizer, loader, lr_scheduler)
    if controller is None:
        controller = BatchSchedule(SCHEDULE if grow else SCHEDULE[:1], microbatch=MICRO)
    tracker = AcceleratorTracker(acc, model, optimizer, lr_scheduler=lr_scheduler, controller=controller)
    return dict(acc=acc, model=model, optimizer=optimizer, loader=loader, lr_scheduler=lr_scheduler,
                tracker=tracker, max_train_steps=max_train_steps)


def _run_clm(p: dict[str, Any], *, stop: str, num_train_epochs: int, starting_epoch: int = 0,
             resume_step: int | None = None, completed_steps: int = 0, checkpointing_steps: Any = None,
             save: Any = None, rows: list | None = None, set_epoch: bool = False) -> list[tuple[float, int, float]]:
    """The training loop of run_clm_no_trainer.py (its lines, with the tracker's two), one row per optimizer
    step: (tokens seen, accumulation, lr). ``stop``: "completed_steps" (the script's) or "tracker" (the README's)."""
    acc, model, optimizer, lr_scheduler, tracker = p["acc"], p["model"], p["optimizer"], p["lr_scheduler"], p["tracker"]
    rows = [] if rows is None else rows
    for epoch in range(starting_epoch, num_train_epochs):
        model.train()
        if epoch == starting_epoch and resume_step is not None:
            active_dataloader = acc.skip_first_batches(p["loader"], resume_step)
        else:
            active_dataloader = p["loader"]
        if set_epoch:  # the guide's line: a resumed process would count the loader's epochs from 0
            active_dataloader.set_epoch(epoch)
        for _step, batch in enumerate(active_dataloader):
            with tracker.accumulate(labels=batch["labels"][..., 1:]):
                outputs = model(**batch)
                loss = outputs.loss
                acc.backward(loss)
                if acc.sync_gradients:
                    record = tracker.step()
                    rows.append((record.tokens_seen, record.accumulation_steps, record.lr))
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if acc.sync_gradients:
                completed_steps += 1
            if isinstance(checkpointing_steps, int):
                if completed_steps % checkpointing_steps == 0 and acc.sync_gradients:
                    save(f"step_{completed_steps}")
            if stop == "completed_steps" and completed_steps >= p["max_train_steps"]:
                break
            if stop == "tracker" and tracker.done(p["max_train_steps"]):
                break
        if checkpointing_steps == "epoch":
            save(f"epoch_{epoch}")
    return rows


def _constant(batches: int, max_train_steps: int) -> list[tuple[float, int, float]]:
    p = _clm_parts(batches, max_train_steps, grow=False)
    return _run_clm(p, stop="completed_steps", num_train_epochs=1)


def _epochs(batches: int, max_train_steps: int) -> int:
    """run_clm's ``num_train_epochs = ceil(max_train_steps / num_update_steps_per_epoch)``."""
    return math.ceil(max_train_steps / math.ceil(batches / A0))


def _same_rows(got: list[tuple[float, int, float]], want: list[tuple[float, int, float]]) -> None:
    assert [(t, a) for t, a, _ in got] == [(t, a) for t, a, _ in want]
    assert [lr for *_, lr in got] == pytest.approx([lr for *_, lr in want], rel=1e-12)


def _lr_at(constant: list[tuple[float, int, float]], tokens_before: float) -> float:
    """The constant run's LR at the step that starts at ``tokens_before``."""
    for (seen, _, lr) in constant:
        if seen - A0 * MICRO == tokens_before:
            return lr
    raise AssertionError(f"no constant-batch step starts at {tokens_before} tokens")


# ---------------------------------------------------------------------------- run_clm: max_train_steps
def test_run_clm_stopping_on_completed_steps_warns_that_the_scheduler_ran_past_its_end():
    p = _clm_parts(400, max_train_steps=40)
    with pytest.warns(UserWarning, match=r"LR scheduler \(LambdaLR\) reached the end it was sized for \(40 "
                      r"scheduler steps.*tracker\.done\(max_train_steps\)") as caught:
        rows = _run_clm(p, stop="completed_steps", num_train_epochs=1)
    assert sum("reached the end it was sized for" in str(w.message) for w in caught) == 1  # once
    # what it warns about: 40 optimizer steps of up to 8 microbatches, far past the constant run's 1,280 tokens
    assert rows[-1][0] > 2 * 40 * A0 * MICRO
    assert max(lr for *_, lr in rows[-5:]) > 0.005  # the cosine rose again (it ends at 0)


def test_run_clm_stopping_on_tracker_done_ends_on_the_constant_runs_data_and_lr():
    constant = _constant(400, 40)
    assert constant[-1][0] == 40 * A0 * MICRO
    p = _clm_parts(400, max_train_steps=40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        rows = _run_clm(p, stop="tracker", num_train_epochs=1)
    assert sorted({a for _, a, _ in rows}) == [2, 4, 8]
    last_window = rows[-1][1] * MICRO
    assert constant[-1][0] <= rows[-1][0] < constant[-1][0] + last_window  # the constant run's tokens
    assert p["tracker"].starting_batch_steps >= 40 and not p["tracker"].done(41 + rows[-1][1] // A0)
    for seen, a, lr in rows:  # the LR of the constant run at the same data, times sqrt(A / A0)
        before = seen - a * MICRO
        steps_in = int(before // (A0 * MICRO))
        if steps_in < len(constant):
            assert lr == pytest.approx(_lr_at(constant, steps_in * A0 * MICRO) * math.sqrt(a / A0), rel=1e-12)
    assert rows[-1][2] <= constant[-1][2] * math.sqrt(8 / A0) * (1 + 1e-12)  # the cosine's end, not a second rise


# ---------------------------------------------------------------------------- run_clm: --resume_from_checkpoint
def _saver(p: dict[str, Any], tmp_path, saved: dict[str, str]):
    def save(name: str) -> None:
        path = str(tmp_path / name)
        p["acc"].save_state(path)
        saved[name] = path
    return save


@pytest.mark.parametrize("arithmetic", ["run_clm", "tracker"])
def test_run_clm_resume_from_a_step_checkpoint(tmp_path, arithmetic):
    """The script's `resume_step = step * gradient_accumulation_steps` after growth: warned, naming the fix;
    `divmod(tracker.resume_position(), len(train_dataloader))`: the uninterrupted run, step for step."""
    batches, max_train_steps = 30, 40
    epochs = _epochs(batches, max_train_steps)
    saved: dict[str, str] = {}
    full = _clm_parts(batches, max_train_steps)
    full_rows = _run_clm(full, stop="tracker", num_train_epochs=epochs, checkpointing_steps=15,
                         save=_saver(full, tmp_path, saved))
    assert "step_15" in saved and full_rows[14][1] > A0  # a checkpoint after growth
    p = _clm_parts(batches, max_train_steps)
    p["acc"].load_state(saved["step_15"])
    tracker, length = p["tracker"], len(p["loader"])
    if arithmetic == "run_clm":  # its lines
        resume_step = 15 * A0
        starting_epoch = resume_step // length
        completed_steps = resume_step // A0
        resume_step -= starting_epoch * length
    else:  # the README's
        starting_epoch, resume_step = divmod(tracker.resume_position(), length)
        completed_steps = tracker.steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = _run_clm(p, stop="tracker", num_train_epochs=epochs, starting_epoch=starting_epoch,
                        resume_step=resume_step, completed_steps=completed_steps)
    found = [str(w.message) for w in caught if "resumed with the data loader" in str(w.message)]
    if arithmetic == "run_clm":
        assert len(found) == 1, found
        assert f"starting at batch {resume_step} of its epoch of {length}" in found[0]
        assert f"had run {tracker.resume_position()} loader batches" in found[0]
        assert "divmod(tracker.resume_position(), len(train_dataloader))" in found[0]
        assert tracker.resume_position() % length != resume_step  # (what it warns about: another position)
    else:
        assert not found
        assert tracker.resume_position() == sum(a for _, a, _ in full_rows[:15])
        _same_rows(rows, full_rows[15:])


def _trained_rows(p: dict[str, Any]) -> list[tuple[int, ...]]:
    """Every row the model trains on, in order (the truth of which data ran)."""
    rows: list[tuple[int, ...]] = []
    p["model"].register_forward_pre_hook(
        lambda m, args, kwargs: rows.extend(tuple(r) for r in kwargs["input_ids"].tolist()), with_kwargs=True)
    return rows


@pytest.mark.parametrize("seedable", [False, True])
def test_run_clm_resume_with_a_shuffled_loader_warns_unless_the_sampler_is_seedable(tmp_path, seedable):
    """Accelerate's default sampler draws the resumed epoch in a new order: samples trained before the checkpoint
    train again and others never do, and the tracker warns once, naming use_seedable_sampler=True. With the
    seedable sampler the resumed run trains the uninterrupted run's rows, in order, with its steps and LR."""
    batches, max_train_steps = 100, 60
    epochs = _epochs(batches, max_train_steps)
    saved: dict[str, str] = {}
    full = _clm_parts(batches, max_train_steps, shuffle=True, seedable=seedable)
    full_seen = _trained_rows(full)
    full_rows = _run_clm(full, stop="tracker", num_train_epochs=epochs, checkpointing_steps=15,
                         save=_saver(full, tmp_path, saved), set_epoch=True)
    p = _clm_parts(batches, max_train_steps, shuffle=True, seedable=seedable)
    seen = _trained_rows(p)
    p["acc"].load_state(saved["step_15"])
    tracker, length = p["tracker"], len(p["loader"])
    starting_epoch, resume_step = divmod(tracker.resume_position(), length)
    assert starting_epoch == 0 and 0 < resume_step < length  # inside the first epoch, after growth
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = _run_clm(p, stop="tracker", num_train_epochs=epochs, starting_epoch=starting_epoch,
                        resume_step=resume_step, completed_steps=tracker.steps, set_epoch=True)
    found = [str(w.message) for w in caught if "use_seedable_sampler" in str(w.message)]
    before = full_seen[:resume_step * ROWS]
    epoch0 = seen[:(length - resume_step) * ROWS]  # the rest of the first epoch, as the resumed run drew it
    again = len(set(epoch0) & set(before))
    never = len(set(full_seen[:length * ROWS]) - set(before) - set(epoch0))
    if seedable:
        assert found == [] and again == never == 0
        assert seen == full_seen[resume_step * ROWS:]
        _same_rows(rows, full_rows[15:])
    else:
        assert again > 0 and never == again  # what it warns about (the epoch's rows are all distinct)
        assert len(found) == 1, found
        assert f"resumed inside an epoch ({resume_step} of its {length} loader batches" in found[0]
        assert "DataLoaderConfiguration(use_seedable_sampler=True)" in found[0]


def test_run_clm_epoch_checkpoint_inside_a_window_warns_and_the_trackers_position_loses_nothing(tmp_path):
    """--checkpointing_steps epoch: the epoch of 28 batches ends inside a window of 4 (26 + 4); the save warns
    with the microbatches and tokens it leaves out; the resume at the script's next epoch warns; the resume at
    tracker.resume_position() runs those microbatches again and continues as the uninterrupted run."""
    batches, max_train_steps = 28, 40
    epochs = _epochs(batches, max_train_steps)
    saved: dict[str, str] = {}
    full = _clm_parts(batches, max_train_steps)
    with pytest.warns(UserWarning, match=r"a checkpoint \(state_dict\(\)\) was taken inside a window: 2 of its 4 "
                      r"microbatches per rank \(32 tokens on this rank\).*tracker\.resume_position\(\)"):
        full_rows = _run_clm(full, stop="tracker", num_train_epochs=epochs, checkpointing_steps="epoch",
                             save=_saver(full, tmp_path, saved))
    steps_before = sum(1 for seen, _, _ in full_rows if seen <= 26 * MICRO)
    # the script's epoch resume: the next epoch from its first batch
    p = _clm_parts(batches, max_train_steps)
    p["acc"].load_state(saved["epoch_0"])
    assert p["tracker"].resume_position() == 26
    with pytest.warns(UserWarning, match=r"resumed with the data loader starting at batch 0 of its epoch of 28, but "
                      r"the checkpoint's windows had run 26 loader batches.*if the loop started the next epoch .*"
                      r"the last 2 loader batches of the checkpoint's epoch are never trained"):
        _run_clm(p, stop="tracker", num_train_epochs=epochs, starting_epoch=1)
    # the tracker's position: the window's first two microbatches again, then on as if never stopped
    p = _clm_parts(batches, max_train_steps)
    p["acc"].load_state(saved["epoch_0"])
    starting_epoch, resume_step = divmod(p["tracker"].resume_position(), len(p["loader"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = _run_clm(p, stop="tracker", num_train_epochs=epochs, starting_epoch=starting_epoch,
                        resume_step=resume_step)
    assert (starting_epoch, resume_step) == (0, 26)
    _same_rows(rows, full_rows[steps_before:])


def test_a_run_that_ends_inside_a_window_says_how_many_microbatches_and_tokens_were_never_stepped():
    p = _clm_parts(28, max_train_steps=1000)
    _run_clm(p, stop="tracker", num_train_epochs=1)  # the loader's 28 batches end inside a window of 4
    with pytest.warns(UserWarning, match=r"the run ended inside a window: 2 of its 4 microbatches per rank "
                      r"\(32 tokens on this rank\).*tracker\.done\(max_steps\).*A loop that already breaks after "
                      r"each batch ended here because its data did.*itertools\.count\(starting_epoch\).*"
                      r"next epoch's first 2 batch\(es\)"):
        p["tracker"]._finalizer()  # what the interpreter's exit runs
    # the fix it names, on run_clm's loop (which breaks after each batch): the budget of the data, 1 epoch of
    # 14 steps at the starting batch, and the epochs run on until tracker.done: the window finishes on the next
    # epoch's first 2 batches, every microbatch is stepped, the run stops at the 28 batches' data plus that window's
    fixed = _clm_parts(28, max_train_steps=_epochs(28, 14) * math.ceil(28 / A0))
    fixed_rows = _run_clm(fixed, stop="tracker", num_train_epochs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed["tracker"]._finalizer()
    assert fixed["tracker"].done(14) and fixed_rows[-1][0] == 30 * MICRO and fixed_rows[-1][1] == 4
    stepped = _clm_parts(30, max_train_steps=1000)
    _run_clm(stepped, stop="tracker", num_train_epochs=1)  # 30 batches: the last window whole
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stepped["tracker"]._finalizer()


# ---------------------------------------------------------------------------- LitGPT's pretrain.py
def get_lr(learning_rate: float, it: int, warmup_iters: int, max_iters: int, min_lr: float) -> float:
    """LitGPT's get_lr: linear warm-up, then cosine to min_lr (``it`` counts microbatches)."""
    if it < warmup_iters:
        return learning_rate * it / warmup_iters
    if it > max_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (max_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


LR, MAX_ITERS, WARMUP_ITERS = 0.01, 120, 20


def _fabric_parts() -> tuple[Any, Any, Any, Any]:
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(*(lambda m: (m, torch.optim.AdamW(m.parameters(), lr=LR)))(TinyLM()))
    data = Blocks(400)
    batches = iter(torch.utils.data.DataLoader(data, batch_size=ROWS))
    return fabric, model, optimizer, batches


def _litgpt_constant() -> list[tuple[int, float]]:
    """LitGPT's fit() as written, at a constant accumulation of A0: (iter_num after the step, lr) per step."""
    fabric, model, optimizer, train_iterator = _fabric_parts()
    iter_num, rows = 0, []
    for train_data in train_iterator:
        if iter_num >= MAX_ITERS:
            break
        lr = get_lr(LR, iter_num, WARMUP_ITERS, MAX_ITERS, 0.1 * LR)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        iter_num += 1
        is_accumulating = iter_num % A0 != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = model(**train_data).loss
            fabric.backward(loss / A0)
        if not is_accumulating:
            rows.append((iter_num, optimizer.param_groups[0]["lr"]))
            optimizer.step()
            optimizer.zero_grad()
    return rows


def test_litgpt_loop_on_the_microbatch_clock_keeps_its_data_and_schedule():
    constant = dict(_litgpt_constant())
    fabric, model, optimizer, train_iterator = _fabric_parts()
    tracker = CBSTracker(model, optimizer, accumulation_steps=A0, controller=BatchSchedule(SCHEDULE, microbatch=MICRO))
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        while not tracker.done(microbatches=MAX_ITERS):  # the README's Fabric loop
            for _ in range(tracker.accumulation_steps):
                tracker.set_lr(get_lr(LR, tracker.microbatches_seen, WARMUP_ITERS, MAX_ITERS, 0.1 * LR))
                batch = next(train_iterator)
                with tracker.microbatch(labels=batch["labels"][..., 1:]):
                    fabric.backward(model(**batch).loss / tracker.accumulation_steps)
            record = tracker.step()
            rows.append((tracker.microbatches_seen, record.accumulation_steps, optimizer.param_groups[0]["lr"]))
            optimizer.step()
            optimizer.zero_grad()
    assert sorted({a for _, a, _ in rows}) == [2, 4, 8]
    # LitGPT's data: max_iters microbatches, to within the last window
    assert MAX_ITERS <= tracker.microbatches_seen < MAX_ITERS + rows[-1][1]
    assert tracker.tokens_seen == tracker.microbatches_seen * MICRO
    # its schedule at the same data, times the coupling
    for iter_num, a, lr in rows:
        if iter_num in constant:
            assert lr == pytest.approx(constant[iter_num] * math.sqrt(a / A0), rel=1e-12), iter_num
        else:
            assert iter_num > MAX_ITERS
    assert sum(n in constant for n, _, _ in rows) >= len(rows) - 1


def test_litgpt_loop_assigning_its_lr_itself_is_warned_with_the_microbatch_clock():
    fabric, model, optimizer, train_iterator = _fabric_parts()
    tracker = CBSTracker(model, optimizer, accumulation_steps=A0, controller=BatchSchedule(SCHEDULE, microbatch=MICRO))
    iter_num = 0
    with pytest.warns(UserWarning, match=r"learning rate was set from outside the tracker") as caught:
        while iter_num < MAX_ITERS:
            for _ in range(tracker.accumulation_steps):
                lr = get_lr(LR, iter_num, WARMUP_ITERS, MAX_ITERS, 0.1 * LR)
                for param_group in optimizer.param_groups:
                    param_group["lr"] = lr  # LitGPT's own line
                iter_num += 1
                batch = next(train_iterator)
                with tracker.microbatch(labels=batch["labels"][..., 1:]):
                    fabric.backward(model(**batch).loss / tracker.accumulation_steps)
            tracker.step()
            optimizer.step()
            optimizer.zero_grad()
    found = [str(w.message) for w in caught if "from outside the tracker" in str(w.message)]
    assert len(found) == 1
    assert "tracker.microbatches_seen for one written in microbatches per rank (LitGPT's get_lr(iter_num))" in found[0]
    assert "tracker.done(microbatches=max_iters)" in found[0]
    assert "one clocked in microbatches, like LitGPT's iter_num, does not" in found[0]


def test_done_takes_one_budget_and_names_a_bad_one():
    model = nn.Linear(2, 1)
    tracker = CBSTracker(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"done\(\): give exactly one budget.*got none"):
        tracker.done()
    with pytest.raises(TypeError, match=r"got \{'steps': 3, 'tokens': 5\}"):
        tracker.done(3, tokens=5)
    with pytest.raises(ValueError, match=r"done\(microbatches=-1\): must be an int >= 0"):
        tracker.done(microbatches=-1)
    with pytest.raises(ValueError, match=r"done\(steps=2.5\): must be an int >= 0"):
        tracker.done(2.5)
    assert tracker.done(0) and tracker.done(tokens=0) and not tracker.done(1)


# ---------------------------------------------------------------------------- the guide's Accelerate block
def _guide_block() -> str:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    found = [b for b in blocks if "AcceleratorTracker(accelerator" in b and "load_state" in b]
    assert len(found) == 1, "the guide's Accelerate block moved"
    return found[0]


def test_the_guides_accelerate_block_runs_as_written_and_resumes_the_uninterrupted_run(tmp_path, monkeypatch):
    """The block exec'd as the guide prints it, with run_clm_no_trainer's names (``args``, the model, the shuffled
    loader, the scheduler sized in optimizer steps, ``checkpointing_steps``) around it; a checkpoint after growth
    resumes as the uninterrupted run: the same rows in the same order, the same steps and LR.
    ``BatchSizeController()`` is swapped for the test's schedule (growth within 60 steps of a tiny model)."""
    from types import SimpleNamespace

    from cbs_tracker.integrations.accelerate import AcceleratorTracker
    from transformers import get_scheduler

    import cbs_tracker

    monkeypatch.setattr(cbs_tracker, "BatchSizeController", lambda: BatchSchedule(SCHEDULE, microbatch=MICRO))
    block = _guide_block()
    steps: list[tuple[float, int, float]] = []
    real_step = AcceleratorTracker.step

    def step(self: Any) -> Any:
        record = real_step(self)
        steps.append((record.tokens_seen, record.accumulation_steps, record.lr))
        return record

    monkeypatch.setattr(AcceleratorTracker, "step", step)

    def run(resume: str | None) -> tuple[list, list, dict]:
        aw.reset_accelerate()
        steps.clear()
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        loader = torch.utils.data.DataLoader(Blocks(100 * ROWS), batch_size=ROWS, shuffle=True)
        names = dict(
            args=SimpleNamespace(gradient_accumulation_steps=A0, resume_from_checkpoint=resume, num_train_epochs=2,
                                 max_train_steps=60, output_dir=str(tmp_path)),
            model=model, optimizer=optimizer, train_dataloader=loader, checkpointing_steps=15,
            lr_scheduler=get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=2, num_training_steps=60),
        )
        seen: list[tuple[int, ...]] = []
        model.register_forward_pre_hook(
            lambda m, args, kwargs: seen.extend(tuple(r) for r in kwargs["input_ids"].tolist()), with_kwargs=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compile(block, "docs/guide.md", "exec"), names)
        # nothing to warn about but the note that a window runs on across the epoch's end
        assert [str(w.message) for w in caught if "data loader ended in microbatch" not in str(w.message)] == []
        return list(steps), seen, names

    full_steps, full_seen, _ = run(None)
    assert sorted({a for _, a, _ in full_steps}) == [2, 4, 8] and len(full_steps) > 15
    assert full_steps[-1][0] >= 60 * A0 * MICRO  # the constant run's data (tracker.done)
    resumed_steps, resumed_seen, names = run(str(tmp_path / "step_15"))
    before = int(full_steps[14][0] // MICRO)  # microbatches of the first 15 steps
    assert names["tracker"].resume_position() >= before and names["starting_epoch"] == 0
    assert resumed_seen == full_seen[before * ROWS:]  # nothing trained twice, nothing skipped
    _same_rows(resumed_steps, full_steps[15:])
