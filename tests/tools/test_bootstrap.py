"""scripts/bootstrap.sh without a package index, as on an offline GPU machine, and the pin check it runs there
(scripts/check_requirements.py): it uses what is installed, names missing or other-version pins in one line,
and stops only when a required pin is missing."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_requirements", REPO / "scripts" / "check_requirements.py")
check = sys.modules.setdefault("check_requirements", importlib.util.module_from_spec(_spec))  # dataclasses need it
_spec.loader.exec_module(check)


def test_pins_comments_and_optional_marks_are_read(tmp_path):
    path = tmp_path / "requirements.txt"
    path.write_text("# a comment line\nnumpy==2.4.6\nnltk==3.10.4  # optional: --split-sentences only\n\n"
                    "-e .\nloose-pkg\nplain==1.0  # not optional, just a note\n")
    assert check.read_pins(str(path)) == [
        check.Pin("numpy", "2.4.6", None), check.Pin("nltk", "3.10.4", "--split-sentences only"),
        check.Pin("loose-pkg", None, None), check.Pin("plain", "1.0", None)]


def test_shipped_pins_mark_as_optional_only_what_a_gpu_image_may_lack():
    pins = [pin for name in ("requirements.txt", "requirements-dev.txt") for pin in check.read_pins(REPO / name)]
    assert {pin.name for pin in pins if pin.optional} == {"nltk", "pyarrow", "zstandard", "wandb", "datasets", "ruff"}
    assert all(pin.version for pin in pins)  # everything else is pinned, and required


def test_verdict_goes_on_with_other_versions_and_stops_on_a_missing_required_pin(monkeypatch):
    installed = {"numpy": "2.4.6", "transformers": "5.17.0"}
    monkeypatch.setattr(check, "installed_version", installed.get)
    pins = [check.Pin("numpy", "2.4.6", None), check.Pin("transformers", "5.24.0", None),
            check.Pin("nltk", "3.10.4", "--split-sentences only")]
    ok, line = check.verdict(pins, "/v/.ptm-pip.log")
    assert ok and line == (
        "[bootstrap] pip could not install the pins (no package index reachable? pip's output: /v/.ptm-pip.log); "
        "going on with what is installed: at other versions than pinned: transformers 5.17.0 (pinned 5.24.0); "
        "not installed (optional): nltk==3.10.4 (--split-sentences only)")
    ok, line = check.verdict(pins + [check.Pin("regex", "2026.11.19", None), check.Pin("tqdm", "4.70.1", None)],
                             "/v/.ptm-pip.log")
    assert not ok and line.startswith("[bootstrap] error: regex==2026.11.19, tqdm==4.70.1 not installed and pip "
                                      "could not install them (no package index reachable?")
    assert "nltk" not in line


def _probe_tree(root: Path, requirements: str, dev_requirements: str) -> None:
    """A project with this repository's bootstrap and pin check, and requirement files of the test's choosing."""
    (root / "scripts").mkdir(parents=True, exist_ok=True)
    for name in ("bootstrap.sh", "check_requirements.py"):
        shutil.copy(REPO / "scripts" / name, root / "scripts" / name)
    (root / "requirements.txt").write_text(requirements)
    (root / "requirements-dev.txt").write_text(dev_requirements)
    (root / "setup.py").write_text('from setuptools import setup\n'
                                   'setup(name="ptm-bootstrap-probe", version="0.1", py_modules=["probe_mod"])\n')
    (root / "probe_mod.py").write_text("WHERE = __file__\n")


def _venv_over_this_env(path: Path, shadow: Path) -> None:
    """A venv that sees this interpreter's packages (torch included) and ``shadow``, as one made with
    --system-site-packages on a GPU machine sees the machine's own."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = subprocess.run([str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip()
    # Every package folder this interpreter reads, which on a GPU machine includes the system's through
    # --system-site-packages: not only its own venv's.
    ours = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]
    Path(site, "outer.pth").write_text("\n".join(dict.fromkeys([str(shadow), *ours])) + "\n")


def _bootstrap_offline(root: Path, venv: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PTM_", "VIRTUAL_ENV"))}
    # No index: no configured index, extra index or wheel folder, only what is installed.
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PTM_VENV=str(venv))
    script = 'source scripts/bootstrap.sh dev && python -c "import probe_mod, sys, torch; print(sys.prefix)"'
    return subprocess.run(["bash", "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.multiprocess
def test_bootstrap_without_an_index_uses_what_is_installed_and_says_what_is_not(tmp_path):
    shadow = tmp_path / "shadow" / "ptm_probe_old-1.0.dist-info"  # a package installed at another version
    shadow.mkdir(parents=True)
    (shadow / "METADATA").write_text("Metadata-Version: 2.1\nName: ptm-probe-old\nVersion: 1.0\n")
    venv, root = tmp_path / "venv", tmp_path / "project"
    _venv_over_this_env(venv, shadow.parent)
    pinned = f"numpy=={metadata.version('numpy')}\n"
    dev = f"pytest=={metadata.version('pytest')}\n"
    stamp = venv / ".ptm-installed-dev"
    # What the terminal shows: the steps, pip's own report kept in its log (nothing to fetch: no package lines).
    steps = [f"[bootstrap] setting up {venv}", "[bootstrap] installing the requirements (requirements.txt "
             "requirements-dev.txt)", "[bootstrap] installing this project (editable)"]

    # Every pin installed: pip needs no index; the venv is stamped and nothing is said.
    _probe_tree(root, pinned, dev)
    run = _bootstrap_offline(root, venv)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout.splitlines() == steps + [str(venv)]
    assert stamp.exists()

    # A pin at another version and a missing optional one: one line, and the installed packages are used.
    _probe_tree(root, pinned + "ptm-probe-old==2.0\nptm-probe-absent==1.0  # optional: the probe's feature\n", dev)
    run = _bootstrap_offline(root, venv)
    log = venv / ".ptm-pip.log"
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == [
        f"[bootstrap] pip could not install the pins (no package index reachable? pip's output: {log}); going on "
        f"with what is installed: at other versions than pinned: ptm-probe-old 1.0 (pinned 2.0); not installed "
        f"(optional): ptm-probe-absent==1.0 (the probe's feature)"]
    assert run.stdout.splitlines() == steps + [str(venv)]
    assert "ptm-probe-old==2.0" in log.read_text()  # pip did try, without an index
    stamp_before = stamp.read_text()

    # A required pin missing: one line naming it, exit 1, not stamped.
    _probe_tree(root, pinned + "ptm-probe-required==1.0\n", dev)
    run = _bootstrap_offline(root, venv)
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        f"[bootstrap] error: ptm-probe-required==1.0 not installed and pip could not install it (no package index "
        f"reachable? pip's output: {log}); install it, or give pip an index (PIP_INDEX_URL) or wheels "
        f"(PIP_FIND_LINKS)"]
    assert "Traceback" not in run.stdout + run.stderr and stamp.read_text() == stamp_before
