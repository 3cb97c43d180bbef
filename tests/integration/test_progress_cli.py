"""Progress in a log file (not a terminal), through the real tokenize action: periodic lines with done/total, rate
and ETA (moved from tests/unit/test_progress.py: this test runs the script)."""


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
