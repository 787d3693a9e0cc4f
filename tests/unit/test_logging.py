"""zerospeed.utils.logging: DeepSpeed's `log_dist` semantics and the rank-0 filter on set-up loggers
(Note [rank-0 logging]). The rank is simulated with $RANK, or with torch.distributed's answers."""

import logging

import pytest
import torch

from zerospeed.optim.factory import build_optimizer
from zerospeed.utils import log_dist, logger
from zerospeed.utils.logging import current_rank, get_logger


@pytest.fixture
def rank(monkeypatch):
    """rank(r): make this process look like global rank r of a job launched with $RANK (None: no job)."""

    def set_rank(r):
        if r is None:
            monkeypatch.delenv("RANK", raising=False)
        else:
            monkeypatch.setenv("RANK", str(r))

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    return set_rank


def logged(caplog, name="zerospeed"):
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == name]


@pytest.mark.parametrize(
    "r, ranks, expected",
    [
        (None, None, "[Rank -1] hi"),  # a single process always logs, as rank -1 (DeepSpeed)
        (None, [3], "[Rank -1] hi"),
        (0, [0], "[Rank 0] hi"),
        (1, [0], None),
        (1, [0, 1], "[Rank 1] hi"),
        (1, [-1], "[Rank 1] hi"),  # -1: every rank
        (0, None, None),  # distributed and no ranks: nowhere, as in DeepSpeed
        (0, [], None),
    ],
)
def test_log_dist_follows_deepspeed(caplog, rank, r, ranks, expected):
    rank(r)
    with caplog.at_level(logging.INFO, logger="zerospeed"):
        log_dist("hi", ranks=ranks)
    assert logged(caplog) == ([] if expected is None else [(logging.INFO, expected)])


def test_log_dist_level_and_caller(caplog, rank):
    rank(0)
    with caplog.at_level(logging.INFO, logger="zerospeed"):
        log_dist("careful", ranks=[0], level=logging.WARNING)
    (record,) = caplog.records
    assert (record.levelno, record.getMessage()) == (logging.WARNING, "[Rank 0] careful")
    assert record.funcName == "test_log_dist_level_and_caller"  # points at the caller, not at log_dist


def test_torch_distributed_rank_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 3)
    assert current_rank() == 3
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert current_rank() == 0
    monkeypatch.setenv("RANK", "")
    assert current_rank() is None


def test_filtered_logger_passes_rank_0_rank_specific_records_and_errors(caplog, rank):
    log = get_logger("zerospeed.test_logging")
    assert get_logger("zerospeed.test_logging").filters == log.filters and len(log.filters) == 1  # idempotent
    for r in (0, 1, None):
        rank(r)
        with caplog.at_level(logging.INFO, logger="zerospeed.test_logging"):
            log.info("set-up %s", r)
            log.warning("warning %s", r)
            log.info("mine %s", r, extra={"ranks": [-1]})
            log.info("for rank 1 %s", r, extra={"ranks": [1]})
            log.error("failed %s", r)
    assert [m for _, m in logged(caplog, "zerospeed.test_logging")] == [
        "set-up 0",
        "warning 0",
        "mine 0",
        "failed 0",
        "mine 1",
        "for rank 1 1",
        "failed 1",
        "set-up None",
        "warning None",
        "mine None",
        "for rank 1 None",
        "failed None",
    ]


def test_the_package_logger_is_filtered_too(caplog, rank):
    rank(1)
    with caplog.at_level(logging.INFO, logger="zerospeed"):
        logger.info("set-up")
        logger.info("rank's own", extra={"ranks": [-1]})
    assert logged(caplog) == [(logging.INFO, "rank's own")]


@pytest.mark.parametrize("r, lines", [(0, 1), (1, 0)])
def test_basic_optimizer_is_logged_once_per_job(caplog, rank, r, lines):
    rank(r)
    with caplog.at_level(logging.INFO, logger="zerospeed.optim.factory"):
        build_optimizer("AdamW", {"lr": 1e-3}, [torch.nn.Parameter(torch.zeros(2))])
    assert [m for _, m in logged(caplog, "zerospeed.optim.factory")] == ["basic optimizer: AdamW"] * lines
