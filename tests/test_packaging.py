"""Every package of the source tree is in pyproject.toml's package list, so a wheel (a non-editable
install) carries it: a subpackage left out imports in the editable checkout and fails in a wheel."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_of_the_tree_is_listed_for_the_wheel():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    dirs = config["package-dir"]
    on_disk = set()
    for name, folder in dirs.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            if "__pycache__" in rel:
                continue
            on_disk.add(".".join((name, *rel)))
    assert on_disk - listed == set(), f"packages missing from pyproject.toml: {sorted(on_disk - listed)}"
    assert {"cbs_tracker.calibrate", "cbs_tracker.integrations"} <= on_disk
