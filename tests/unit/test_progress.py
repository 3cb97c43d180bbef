"""Progress in a log file (not a terminal): a plain line at the set interval with done/total, rate and ETA."""

import logging
import time

from pipeline.common.log import Progress


def test_progress_lines_when_not_a_terminal(caplog):
    caplog.set_level(logging.INFO)
    with Progress("tokenize train", total=10, unit="chunk", interval=0.05) as p:
        for _ in range(10):
            time.sleep(0.03)
            p.update(1, loss=1.5)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) >= 3, lines  # periodic lines, plus the final one
    assert any("tokenize train: " in x and "/10 (" in x and "chunk/s" in x and "ETA" in x and "loss 1.5" in x
               for x in lines), lines
    assert "10/10 (100%)" in lines[-1] and "done in" in lines[-1]


def test_quiet_and_resumed_rate(caplog):
    caplog.set_level(logging.INFO)
    with Progress("x", total=5, quiet=True, interval=0) as p:
        p.update(5)
    assert not caplog.records
    p = Progress("train", total=100, unit="step", interval=1000)
    p.n = p.n0 = 90
    p.update(1)
    assert "91/100" in p.line(p.t0 + 1.0) and "1 step/s" in p.line(p.t0 + 1.0)
