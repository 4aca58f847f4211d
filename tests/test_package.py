"""The package surface: exports resolve, optional dependencies stay optional."""

from __future__ import annotations

import subprocess
import sys

import cbs_tracker


def test_every_exported_name_resolves():
    for name in cbs_tracker.__all__:
        assert getattr(cbs_tracker, name) is not None


def test_import_does_not_pull_in_optional_dependencies():
    code = (
        "import sys, cbs_tracker; cbs_tracker.CBSTracker; cbs_tracker.BatchSizeController; "
        "bad = [m for m in ('lightning', 'tensorboard', 'matplotlib') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_integrations_install_inside_the_package_namespace(tmp_path):
    import cbs_tracker.integrations as integ

    assert integ.__name__ == "cbs_tracker.integrations"
    out = subprocess.run([sys.executable, "-c", "import integrations"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)
    assert out.returncode != 0, "no top-level module named 'integrations' may be installed"
