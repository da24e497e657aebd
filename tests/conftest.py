"""Suite-wide rule: under CI (``CI`` set, as ``.ci/run`` runs), only the GPU tests may skip.

Every other skip means a test dependency or a built tool is missing, which on CI is a broken
install, not a reason to report the suite green; such skips are turned into failures there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ALLOWED_SKIP = "needs an NVIDIA GPU"

# tqdm (transformers' loading bars) starts a monitor thread that a bar's __del__ joins while it
# holds tqdm's lock; when a later gc.collect() (hypothesis runs one per example) collects such a
# bar, that join can wait on the monitor forever. Without the monitor there is nothing to join.
try:
    import tqdm

    tqdm.tqdm.monitor_interval = 0
except ImportError:  # pragma: no cover - tqdm comes with transformers, a test dependency
    pass
CACHE = Path(os.environ.get("GRAPHKEEPER_CACHE", Path.home() / ".cache" / "graphkeeper"))
HELM = CACHE / "bin" / "k8s-v1.36.3" / "helm"

# The end-to-end suite needs root and a real node (kubelet, containerd, images): `make test-e2e`.
collect_ignore = [] if os.environ.get("GRAPHKEEPER_E2E") else ["e2e"]


def _strict() -> bool:
    return bool(os.environ.get("CI"))


def _fail_unexpected_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if _strict() and report.skipped and ALLOWED_SKIP not in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which must have every test dependency: {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())


@pytest.fixture(scope="session")
def helm() -> Path:
    """helm as deploy/local/build-bins.sh builds it (chart tests); under CI its absence fails."""
    if not HELM.exists():
        pytest.skip(f"helm is not built ({HELM}); run deploy/local/build-bins.sh")
    return HELM
