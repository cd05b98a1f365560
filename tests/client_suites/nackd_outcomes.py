"""A pytest plugin for scripts/client-suites: writes one line per test,
"NODEID<TAB>OUTCOME" (passed, failed, skipped), to $NACKD_SUITE_OUT when
the session ends. A test whose setup, call or teardown failed has failed.
"""

import os

_outcomes = {}


def pytest_runtest_logreport(report):
    seen = _outcomes.get(report.nodeid)
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and seen is None:
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed and seen is None:
        _outcomes[report.nodeid] = "passed"


def pytest_sessionfinish(session, exitstatus):
    with open(os.environ["NACKD_SUITE_OUT"], "w", encoding="utf-8") as out:
        for nodeid, outcome in sorted(_outcomes.items()):
            out.write(f"{nodeid}\t{outcome}\n")
