"""What the README and docs/ state about the code, against the code.

- the size of the one all-reduce per optimizer step (bytes, and how many float64 numbers);
- the logged tags each doc lists, against the tags the code writes;
- the options docs/options.md lists per adapter, against each adapter's signature;
- docs/design.md's map: every file of the package named, and the imports it says the code has
  (the layering itself: tests/test_import_graph.py);
- the README's one-line growth rule, against the controller's defaults.

A number or a name changed on one side only fails here.
"""

from __future__ import annotations

import gc
import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from cbs_tracker.core import measure
from cbs_tracker.core.tags import TAGS

ROOT = Path(__file__).resolve().parents[1]
DOCS = {
    "README.md": ROOT / "README.md",
    **{f"docs/{p.name}": p for p in sorted((ROOT / "docs").glob("*.md"))},
}
WORDS = {"ten": 10, "twelve": 12, "sixteen": 16, "eighteen": 18, "twenty": 20}


def _text(name: str) -> str:
    return DOCS[name].read_text(encoding="utf-8")


# ------------------------------------------------------------------ the all-reduce


class _Captured(Exception):
    pass


class _TwoRanks:
    """``cbs_tracker.core.distributed`` as ``reduce_window`` sees it on two ranks: the reduced vector is
    captured and the step stopped there."""

    def __init__(self, real):
        self._real = real
        self.sent: list[torch.Tensor] = []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def group_size(self, group):
        return 2

    def all_reduce_sum(self, values, group):
        self.sent.append(values.detach().clone())
        raise _Captured


def _sent_per_step(monkeypatch, measured: bool) -> torch.Tensor:
    """The vector one rank hands to the all-reduce at ``tracker.step()``."""
    from cbs_tracker.integrations.plain import CBSTracker

    fake = _TwoRanks(measure.cbs_dist)
    monkeypatch.setattr(measure, "cbs_dist", fake)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = CBSTracker(model, optimizer, accumulation_steps=2)
    for _ in range(2):
        with tracker.microbatch(size=8):
            model(torch.randn(8, 4)).pow(2).mean().div(2).backward()
    if measured:
        with pytest.raises(_Captured):
            tracker.step()
    else:  # a window the measuring cadence lets pass: its counts go through the same collective
        with pytest.raises(_Captured):
            measure.reduce_window(tracker.collector, list(model.parameters()), dp_group=None, loss_divisor=2.0,
                                  avg_ranks=2, expected_microbatches=2, measured=False)
    (vec,) = fake.sent
    with warnings.catch_warnings():  # the window was left unstepped on purpose
        warnings.simplefilter("ignore")
        del tracker
        gc.collect()
    return vec


@pytest.fixture(scope="module")
def all_reduce() -> tuple[int, int]:
    """``(numbers, bytes)`` of the one all-reduce per step, measured and unmeasured windows alike."""
    mp = pytest.MonkeyPatch()
    try:
        vecs = [_sent_per_step(mp, measured) for measured in (True, False)]
    finally:
        mp.undo()
    for vec in vecs:
        assert vec.dtype == torch.float64 and vec.dim() == 1
    assert vecs[0].numel() == vecs[1].numel()  # every rank calls the same collective whatever the cadence
    return vecs[0].numel(), vecs[0].numel() * vecs[0].element_size()


def _reduce_claims(text: str) -> tuple[list[int], list[int]]:
    """The byte counts and the counts of numbers a text gives for the all-reduce."""
    text = " ".join(text.split())
    bytes_ = [int(b) for b in re.findall(r"all[-_ ]?reduce`* of (\d+) bytes", text, flags=re.I)]
    numbers = []
    for m in re.finditer(r"(?:all[-_ ]?reduce`* of|vector of|\() ?(\d+|[a-z]+) (?:float64 )?numbers", text, flags=re.I):
        n = m.group(1).lower()
        numbers.append(int(n) if n.isdigit() else WORDS.get(n, -1))
    return bytes_, numbers


@pytest.mark.parametrize("name", ["README.md", "docs/results.md", "docs/design.md", "docs/guide.md"])
def test_the_docs_give_the_all_reduce_its_real_size(all_reduce, name):
    numbers, size = all_reduce
    claimed_bytes, claimed_numbers = _reduce_claims(_text(name))
    assert claimed_bytes or claimed_numbers, f"{name} no longer states the all-reduce's size"
    assert all(b == size for b in claimed_bytes), (name, claimed_bytes, size)
    assert all(n == numbers for n in claimed_numbers), (name, claimed_numbers, numbers)


def test_the_code_says_the_same_size(all_reduce):
    numbers, _ = all_reduce
    _, claimed = _reduce_claims(inspect.getsource(measure))
    assert claimed and all(n == numbers for n in claimed), claimed


def test_the_claim_parser_reads_a_wrong_number():
    # what a hand-edited doc would say
    assert _reduce_claims("each rank contributes a vector of ten float64 numbers") == ([], [10])
    assert _reduce_claims("One all-reduce of 80 bytes per step") == ([80], [])


# ------------------------------------------------------------------ the logged tags

CODE_TAGS = {t.tag.format(unit="tokens") for t in TAGS}


def test_the_guide_lists_every_tag_the_code_writes():
    text = _text("docs/guide.md")
    section = text.split("\n## TensorBoard tags\n", 1)[1].split("\n## ", 1)[0]
    per_step = re.search(r"Under `cbs/` against the optimizer step: (.*?); under `cbs_tokens/`", section, flags=re.S)
    per_token = re.search(r"under `cbs_tokens/` the schedule tags \((.*?)\)", section, flags=re.S)
    assert per_step and per_token, "the guide's tag list moved"
    listed = {f"cbs/{n}" for n in re.findall(r"`([a-z_]+)`", per_step.group(1))}
    listed |= {f"cbs_tokens/{n}" for n in re.findall(r"`([a-z_]+)`", per_token.group(1))}
    assert listed == CODE_TAGS, (sorted(listed - CODE_TAGS), sorted(CODE_TAGS - listed))


@pytest.mark.parametrize("name", sorted(DOCS))
def test_every_tag_a_doc_names_is_written_by_the_code(name):
    named = set(re.findall(r"`(cbs(?:_tokens|_samples)?/[a-z_{}]+)`", _text(name)))
    named = {t.replace("{unit}", "tokens").replace("_samples", "_tokens").replace("samples_seen", "tokens_seen")
             for t in named if not t.endswith("/")}
    unknown = {t for t in named if t not in CODE_TAGS}
    assert not unknown, f"{name} names tags the code does not write: {sorted(unknown)}"


# ------------------------------------------------------------------ the options per adapter


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _table_options(section: str) -> set[str]:
    """The names in the first column of a section's option table."""
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([a-z_0-9]+)`", line.split("|")[1]))
    return names


def _mentioned(section: str) -> set[str]:
    return set(re.findall(r"`([a-z_0-9]+)`", section))


def _params(fn, drop=("self", "model", "optimizer", "accelerator", "args", "kwargs", "marks")) -> set[str]:
    return {p for p in inspect.signature(fn).parameters if p not in drop}


OPTIONS = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
SHARED = _table_options(_section(OPTIONS, "Shared by"))


def test_the_plain_loop_options_are_its_signature():
    from cbs_tracker.core.loop import LoopTracker

    documented = SHARED | _table_options(_section(OPTIONS, "Plain loop"))
    assert documented == _params(LoopTracker.__init__)


def test_the_fsdp2_options_are_its_signature():
    from cbs_tracker.integrations.fsdp import FSDPTracker

    from cbs_tracker.core.loop import LoopTracker

    own = _params(FSDPTracker.__init__) - _params(LoopTracker.__init__)
    assert own and own <= _mentioned(_section(OPTIONS, "FSDP2"))


def test_the_accelerate_options_are_its_signature():
    from cbs_tracker.core.loop import LoopTracker

    accelerate = pytest.importorskip("cbs_tracker.integrations.accelerate")
    section = _section(OPTIONS, "Accelerate")
    assert _table_options(section) == _params(accelerate.AcceleratorTracker.__init__)
    # the plain loop's others pass through, except those it names as refused (each refused with its reason)
    source = inspect.getsource(accelerate.AcceleratorTracker.__init__)
    refused = {k for k in _params(LoopTracker.__init__) if f'"{k}"' in source and "not an argument" in source}
    refused_named = _mentioned(section.split("which are refused")[0].split("except those")[1])
    assert refused <= refused_named | {"loss_normalization", "loss_divided_by_accumulation", "grad_scaler"}


def test_the_lightning_options_are_its_signature():
    from cbs_tracker.integrations.lightning import CBSCallback

    documented = SHARED | _table_options(_section(OPTIONS, "Lightning: `CBSCallback"))
    assert documented == _params(CBSCallback.__init__)


def test_the_hugging_face_options_are_its_signature():
    transformers = pytest.importorskip("cbs_tracker.integrations.transformers")
    section = _section(OPTIONS, "Hugging Face")
    params = _params(transformers.CBSTrainer.__init__)
    assert params - SHARED <= _mentioned(section)
    # a shared option it does not take is named as read from the Trainer
    for missing in SHARED - params:
        row = next(line for line in _section(OPTIONS, "Shared by").splitlines() if line.startswith(f"| `{missing}`"))
        assert "Hugging Face: read from the Trainer" in row, missing


def test_the_olmo_core_options_are_its_signature():
    olmo = pytest.importorskip("cbs_tracker.integrations.olmo_core")
    assert _table_options(_section(OPTIONS, "OLMo-core")) == _params(olmo.CBSOlmoCallback.__init__)


@pytest.mark.parametrize("heading, name", [
    ("`BatchSizeController", "BatchSizeController"),
    ("`BatchSchedule", "BatchSchedule"),
    ("`NoiseScaleEstimator", "NoiseScaleEstimator"),
    ("`measure_critical_batch", "measure_critical_batch"),
])
def test_the_policy_options_are_their_signatures(heading, name):
    import cbs_tracker

    fn = getattr(cbs_tracker, name)
    documented = _table_options(_section(OPTIONS, heading))
    params = _params(fn if inspect.isfunction(fn) else fn.__init__)
    if name == "BatchSchedule":
        documented.discard("marks")
    assert documented == params, (sorted(params - documented), sorted(documented - params))


def test_the_controller_defaults_are_the_documented_ones():
    # each default cell of BatchSizeController's table that is a literal (`0.4`, `True`, `None`) is
    # the signature's default: one value for all the names of its row, or one value per name
    import ast

    from cbs_tracker import BatchSizeController

    params = inspect.signature(BatchSizeController.__init__).parameters
    checked = {}
    for line in _section(OPTIONS, "`BatchSizeController").splitlines():
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([a-z_0-9]+)`", line.split("|")[1])
        cells = [c.strip() for c in line.split("|")[2].split(", ")]
        for name, cell in zip(names, cells * len(names) if len(cells) == 1 else cells, strict=True):
            literal = re.fullmatch(r"`([^`]+)`", cell)
            try:
                value = ast.literal_eval(literal.group(1)) if literal else ...
            except (ValueError, SyntaxError):
                continue  # `256·A0`: a rule, not a value
            if value is not ...:
                checked[name] = value
                assert params[name].default == value, name
    assert checked["kappa"] == 0.4 and checked["convert_lr_decay"] is True and checked["conversion_kappa"] == 1.0


def test_the_controllers_first_table_is_the_options_a_user_sets_first_in_its_signature():
    """options.md's first table under BatchSizeController names the options the signature gives first; the
    finer settings (the second table) all come after them."""
    import cbs_tracker

    section = _section(OPTIONS, "`BatchSizeController")
    first, second = section.split("\nThe rules' finer settings", 1)
    params = [p for p in inspect.signature(cbs_tracker.BatchSizeController.__init__).parameters if p != "self"]
    user = _table_options(first)
    assert set(params[:len(user)]) == user, (params[:len(user)], sorted(user))
    assert set(params[len(user):]) == _table_options(second)


# ------------------------------------------------------------------ the design page's structure


def test_the_design_page_names_every_file_of_the_package():
    text = _text("docs/design.md")
    files = [f"{p.parent.name}/{p.name}" for folder in ("core", "policy", "calibrate", "theory")
             for p in sorted((ROOT / "cbs_tracker" / folder).glob("*.py")) if p.name != "__init__.py"]
    files += [f"integrations/{p.name}" for p in sorted((ROOT / "integrations").glob("*.py")) if p.name != "__init__.py"]
    files += ["runlog.py", "commands/calibrate.py", "corpus.py", "gpt.py", "launch.py"]
    missing = [f for f in files if f"`{f}`" not in text]
    assert not missing, f"docs/design.md does not say what these files do: {missing}"


def test_every_import_the_design_page_says_the_code_has_is_there():
    from tests.test_import_graph import EXCEPTIONS, stale_exceptions

    assert len(EXCEPTIONS) >= 10  # the table was read
    assert stale_exceptions() == [], "docs/design.md lists imports the code no longer has"


# ------------------------------------------------------------------ the README's growth rule


def test_the_readme_states_the_growth_rule_the_controller_applies():
    from cbs_tracker import BatchSizeController

    text = " ".join(_text("README.md").split())
    m = re.search(r"doubles the batch when, on (\d+) measurements in a row, `κ` times both the median of the "
                  r"last (\d+) noise scales and the interval's lower end clear twice the current batch by a (\d+)% "
                  r"margin \(`κ = ([\d.]+)`; nothing is decided before those (\d+) are in\)", text)
    assert m, "the README's one-line growth rule moved or changed form"
    patience, window, margin, kappa, filled = (int(m.group(1)), int(m.group(2)), int(m.group(3)), float(m.group(4)),
                                                int(m.group(5)))
    defaults = {k: v.default for k, v in inspect.signature(BatchSizeController.__init__).parameters.items()}
    assert (patience, window, filled, kappa) == (defaults["patience"], defaults["window"], defaults["window"],
                                                 defaults["kappa"])
    assert margin / 100 == pytest.approx(defaults["margin"])
    late = re.search(r"turns each halving of the scheduled LR before the last (\d+)% of the run into a doubling", text)
    assert late, "the README's statement of the LR-decay conversion moved or changed form"
    assert int(late.group(1)) / 100 == pytest.approx(1 - defaults["convert_until"])

    def first_doubling(below: int) -> int:
        """The reading at which the default controller (no warm-up) doubles from B = 8: ``below`` readings
        10% under the bar 2B(1 + margin), then readings just over it, lower ends alike."""
        ctrl = BatchSizeController(warmup_steps=0, warmup_tokens=0)
        bar = 2 * 8 * (1 + margin / 100) / kappa
        for i in range(4 * window):
            v = bar * (0.9 if i < below else 1.01)
            d = ctrl.update(step=i + 1, tokens_seen=8.0 * (i + 1), global_batch=8.0, accumulation_steps=1,
                            noise_scale=v, noise_scale_low=v, noise_scale_high=2 * v)
            if d.accumulation_steps == 2:
                return i + 1
        raise AssertionError("no doubling")

    # from the start: nothing before the window of 32 is full
    assert first_doubling(0) == window
    # after a window below the bar: the median clears it once more than half the window does
    # (window // 2 + 1 readings), then it must hold on `patience` readings in a row
    assert first_doubling(window) == window + window // 2 + 1 + patience - 1
