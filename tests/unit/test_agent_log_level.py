"""The agent's log level comes from ``$FTHARNESS_AGENT_LOG_LEVEL`` (WARNING unless it names one)."""

from __future__ import annotations

import logging

import pytest

from runtime.agent import LOG_LEVEL_ENV, log_level


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, logging.WARNING),
        ("", logging.WARNING),
        ("info", logging.INFO),
        (" DEBUG ", logging.DEBUG),
        ("chatty", logging.WARNING),  # not a level: the default, not an error
        ("10", logging.WARNING),
    ],
)
def test_the_agent_log_level_is_read_from_its_environment(value, want):
    env = {} if value is None else {LOG_LEVEL_ENV: value}
    assert log_level(env) == want
