"""A pytest plugin for test_cuda_suite_collection.py, loaded with ``-p tests.tools.pretend_cuda``.

``--pretend-cuda present|absent``: while test modules are collected (imported), ``torch.cuda.is_available()``
answers as told, so that skip conditions decided at import see a GPU, or none, on any machine. Nothing else
about CUDA is faked: a module that touches CUDA at import still fails to collect, and a condition evaluated
later (a string condition, a skip inside a fixture or a test) is decided by the real answer.

``--outcome-report FILE``: writes one JSON object, ``{"errors": {node: text}, "tests": {node: {"markers":
[...], "setup": outcome, "reason": text}}}``, the collection errors and, per test, its markers and how its
setup ended. With ``--setup-plan`` setup evaluates the skip marks and runs no fixture and no test body."""
from __future__ import annotations

import json

import pytest
import torch


def pytest_addoption(parser):
    group = parser.getgroup("pretend-cuda")
    group.addoption("--pretend-cuda", choices=("present", "absent"), default=None,
                    help="torch.cuda.is_available() answers this while test modules are collected")
    group.addoption("--outcome-report", default=None, help="write collection errors and setup outcomes here")


def pytest_configure(config):
    path = config.getoption("outcome_report")
    if path:
        config.pluginmanager.register(_Outcomes(path), "pretend-cuda-outcomes")


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    answer = session.config.getoption("pretend_cuda")
    real = torch.cuda.is_available
    if answer is not None:
        torch.cuda.is_available = lambda: answer == "present"
    try:
        return (yield)
    finally:
        torch.cuda.is_available = real


class _Outcomes:
    """Collects what --outcome-report writes."""

    def __init__(self, path: str):
        self.path = path
        self.errors: dict[str, str] = {}
        self.tests: dict[str, dict] = {}

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors[report.nodeid] = report.longreprtext

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        for item in items:
            self.tests[item.nodeid] = {"markers": sorted({m.name for m in item.iter_markers()}), "setup": None,
                                       "reason": ""}

    def pytest_runtest_logreport(self, report):
        if report.when != "setup":
            return
        entry = self.tests.setdefault(report.nodeid, {"markers": [], "reason": ""})
        entry["setup"] = report.outcome
        if report.skipped and isinstance(report.longrepr, tuple):
            entry["reason"] = report.longrepr[2]  # (file, line, "Skipped: <reason>")

    def pytest_sessionfinish(self):
        with open(self.path, "w") as f:
            json.dump({"errors": self.errors, "tests": self.tests}, f, indent=1, sort_keys=True)
