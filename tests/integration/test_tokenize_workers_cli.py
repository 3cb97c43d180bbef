"""A bad --workers is one line and exit 2, through the real prepare and tokenize actions (moved from
tests/unit/test_tokenize_workers.py: this test runs the script)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_workers_is_one_line_and_exit_2(value, tmp_path, pipeline_env):
    for args in (["prepare", "--dataset", "chatterbot-corpus", "--seq-length", "64"],
                 ["tokenize", str(tmp_path), "smollm2-135m", "pt"]):
        res = subprocess.run([sys.executable, str(ROOT / "pipeline_data_prepare.py"), *args, "--workers", value],
                             cwd=ROOT, env=pipeline_env, capture_output=True, text=True, timeout=120)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and "--workers" in lines[0]
