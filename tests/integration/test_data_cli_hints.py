"""Data for the right model, and errors that say what to do: prepare --model picks the model's tokenizer
(printed), an offline miss says how to allow the Hub, tokenize on a prepared chat root says what it is."""

from tests.helpers import ROOT, run

PY = str(ROOT / ".venv/bin/python")


def test_prepare_for_nano_uses_nanos_tokenizer_and_says_how_to_get_it_offline(pipeline_env, tmp_path):
    env = {**pipeline_env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    res = run([PY, "pipeline_data_prepare.py", "prepare", "--dataset", "chatterbot-corpus", "--seq-length", "256",
               "--model", "nano", "--dataset-root", str(tmp_path / "d"), "--limit", "20"], env=env)
    assert res.returncode == 2, res.stderr
    assert "tokenizer: nano (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16), the tokenizer of --model nano" in res.stderr
    err = [x for x in res.stderr.splitlines() if x.startswith("error: ")]
    assert len(err) == 1 and "run once with HF_HUB_OFFLINE=0" in err[0] and "Traceback" not in res.stderr


def test_tokenize_on_a_prepared_chat_root_says_what_it_is(pipeline_env, tmp_path):
    root = tmp_path / "chat"
    res = run([PY, "pipeline_data_prepare.py", "prepare", "--dataset", "chatterbot-corpus", "--seq-length", "256",
               "--dataset-root", str(root), "--limit", "20", "--quiet"], env=pipeline_env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "tokenizer: smollm2-135m" in res.stderr  # the default is printed
    res = run([PY, "pipeline_data_prepare.py", "tokenize", str(root), "smollm2-135m", "pt", "--quiet"], env=pipeline_env)
    assert res.returncode == 2 and "looks like a prepared chat dataset" in res.stderr, res.stderr
