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


def test_tokenize_logs_progress_lines_into_a_log_file(tmp_path, pipeline_env):
    """pipeline_data_prepare.py tokenize with its output going to a file (not a terminal): periodic lines."""
    from tests.helpers import ROOT, run

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(400):
        (corpus / f"d{i:04d}.txt").write_text(f"document {i} " + "some words " * 50)
    env = {**pipeline_env, "PIPELINE_PROGRESS_INTERVAL": "0.01"}
    res = run([str(ROOT / ".venv/bin/python"), "pipeline_data_prepare.py", "tokenize", str(corpus), "smollm2-135m",
               "pt", "--output-dir", str(tmp_path / "out"), "--docs-per-part", "20"], env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if "tokenize: " in x and " doc/s" in x]
    assert len(lines) >= 3, res.stderr[-3000:]
    assert "tokenize: 400 doc" in lines[-1] and "done in" in lines[-1]
