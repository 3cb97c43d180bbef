"""Never silently wrong, round 2 (issue 22): the reproductions of the hostile review, area by area, each asserting
the one-line error or the correct result. Other items live beside the code they test: loss masks
(test_loss_masks.py), the script's own --exclude (test_badnodes.py), bounded calc (test_experiment_spec.py), the
worker cap (test_tokenize_workers.py)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from pipeline.common.errors import UserError
from pipeline.common.io import read_json
from pipeline.data.indexed import tokenize_corpus
from pipeline.data.sources import input_identity


# ---- data: a text corpus folder is what its fingerprint covers -------------------------------------------------
def corpus(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    for i in range(3):
        (d / f"doc{i}.txt").write_text(f"document {i} " * 50)
    (d / "sub" / "notes.md").write_text("# notes\n" * 20)
    return d


def tokenize(d: Path, out: Path, name: str = "corpus") -> dict:
    return tokenize_corpus(str(d), "smollm2-135m", out, name, quiet=True, workers=1)


@pytest.mark.parametrize("change", ["add", "edit", "delete", "rename"])
def test_a_changed_text_folder_is_tokenized_again(tmp_path, change):
    """The fingerprint of a folder of text files covered no file ("files": 0): adding three files and editing one
    returned the old .bin/.idx with exit 0 (item 2)."""
    d, out = corpus(tmp_path), tmp_path / "out"
    first = tokenize(d, out)
    assert first["documents"] == 4 and first["fingerprint"]["input"]["files"] == 4
    time.sleep(0.01)
    if change == "add":
        (d / "doc9.txt").write_text("a new document " * 30)
    elif change == "edit":
        (d / "doc0.txt").write_text("edited " * 300)
    elif change == "delete":
        (d / "doc1.txt").unlink()
    else:
        (d / "doc2.txt").rename(d / "doc2b.txt")
    again = tokenize(d, out)
    assert again["fingerprint"]["input"] != first["fingerprint"]["input"]
    want = {"add": 5, "edit": 4, "delete": 3, "rename": 4}[change]
    assert again["documents"] == want
    if change in ("add", "edit"):
        assert again["tokens"] != first["tokens"]


def test_the_fingerprint_is_the_list_that_is_read(tmp_path):
    d = corpus(tmp_path)
    (d / "image.png").write_bytes(b"\x89PNG\0\0")  # not a text suffix: neither read nor fingerprinted
    ident = input_identity(str(d), exclude=d / "out")
    assert ident["kind"] == "dir" and ident["files"] == 4
    (d / "out").mkdir()
    (d / "out" / "stale.txt").write_text("an output folder inside the corpus is not part of it")
    assert input_identity(str(d), exclude=d / "out") == ident


def test_binary_files_are_skipped_and_counted(tmp_path, caplog):
    d = corpus(tmp_path)
    (d / "blob.txt").write_bytes(b"text\0\x01\x02binary")
    res = tokenize(d, tmp_path / "out")
    assert res["documents"] == 4 and "skipped 1 binary file(s)" in caplog.text


def test_code_and_markdown_folders_are_corpora(tmp_path):
    d = tmp_path / "code"
    d.mkdir()
    (d / "a.py").write_text("def f():\n    return 1\n" * 20)
    (d / "README.md").write_text("# readme\n" * 10)
    assert tokenize(d, tmp_path / "out")["documents"] == 2  # was: "no documents (field 'text')"


def test_glob_chooses_the_files_of_a_corpus_folder(tmp_path):
    d = corpus(tmp_path)
    (d / "data.jsonl").write_text('{"text": "a row, read as a text file only when --glob picks it"}\n')
    res = tokenize_corpus(str(d), "smollm2-135m", tmp_path / "out", "c", quiet=True, workers=1, glob="*.md")
    assert res["documents"] == 1 and res["fingerprint"]["input"]["files"] == 1  # sub/notes.md: '*' crosses folders
    both = tokenize_corpus(str(d), "smollm2-135m", tmp_path / "out", "c", quiet=True, workers=1, glob="doc[01].txt")
    assert both["documents"] == 2 and both["fingerprint"] != res["fingerprint"]  # tokenized again, not reused
    with pytest.raises(UserError, match=r"has no documents .*the files --glob '\*.rs' matches"):
        tokenize_corpus(str(d), "smollm2-135m", tmp_path / "out2", "c", quiet=True, workers=1, glob="*.rs")
    with pytest.raises(UserError, match="--glob chooses the files of a corpus folder, and .* is not a folder"):
        tokenize_corpus(str(d / "doc0.txt"), "smollm2-135m", tmp_path / "out3", "c", quiet=True, glob="*")


def test_an_empty_corpus_is_an_error(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(UserError, match="has no documents"):
        tokenize(d, tmp_path / "out")


def test_the_output_name_is_the_file_written(tmp_path):
    """An output name with a dot wrote corpus.bin/.idx while reporting corpus.v2_text_document (item 3)."""
    res = tokenize(corpus(tmp_path), tmp_path / "out", "corpus.v2")
    assert res["prefix"] == str(tmp_path / "out" / "corpus.v2_text_document")
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith(".")) == [
        "corpus.v2_text_document.bin", "corpus.v2_text_document.idx", "token_count.json"]


@pytest.mark.parametrize("name", ["../../escape", "a/b", "..", ".hidden", "", "-rf", "x\0y"])
def test_an_output_name_that_is_a_path_is_refused(tmp_path, name):
    """``../../escape`` wrote outside the output directory (item 3)."""
    with pytest.raises(UserError, match="must be a file name"):
        tokenize(corpus(tmp_path), tmp_path / "out", name)
    assert not (tmp_path.parent / "escape_text_document.bin").exists()


# ---- the bad-node log: through its symlink, never a FIFO ---------------------------------------------------------
def test_a_symlinked_team_log_stays_the_teams(tmp_path):
    """--unmark-bad through BAD_NODES_LOG=link.log replaced the link by a private copy; later marks went to the copy
    and the lock beside the link no longer serialised users of the target (item 5)."""
    from pipeline.slurm.badnodes import BadNodeLog

    shared = tmp_path / "shared"
    shared.mkdir()
    team = shared / "team.log"
    BadNodeLog(team).mark("nid000001", "Xid 79")
    link = tmp_path / "link.log"
    link.symlink_to(team)
    log = BadNodeLog(link)
    assert log.unmark("nid000001") == 1
    assert link.is_symlink() and os.readlink(link) == str(team)
    assert BadNodeLog(team).entries() == []
    log.mark("nid000002", "ECC")
    assert [e.node for e in BadNodeLog(team).entries()] == ["nid000002"]
    assert (shared / "team.log.lock").exists() and not (tmp_path / "link.log.lock").exists()


# ---- checkpoint: fidelity decides an export, quality is reported ----------------------------------------------
@pytest.fixture(scope="module")
def random_init_pair(tokenizer):
    """A random-init model and its exact copy: a perfect conversion of a model that learned nothing."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    src = LlamaForCausalLM(cfg).eval()
    return src, copy.deepcopy(src).eval()


def test_a_perfect_conversion_of_an_untrained_model_passes(random_init_pair, tokenizer):
    """A 16-iteration from-scratch export with logit difference 0.0 FAILED on its reference loss (item 10)."""
    from pipeline.checkpoint.verify import verify

    src, exp = random_init_pair
    rec = verify(src, exp, tokenizer)
    assert rec["verdict"] == "PASS" and rec["max_abs_logit_diff"] == 0.0 and rec["decided_on"] == "conversion fidelity"
    assert any("not well below the uniform-guess loss" in w for w in rec["quality"]["warnings"]), rec["quality"]
    strict = verify(src, exp, tokenizer, require_quality=True)
    assert strict["verdict"] == "FAIL" and any("uniform-guess" in f for f in strict["failures"])


def test_an_unfaithful_conversion_still_fails(random_init_pair, tokenizer):
    import copy

    import torch

    from pipeline.checkpoint.verify import verify

    src, exp = random_init_pair
    bad = copy.deepcopy(exp)
    with torch.no_grad():
        bad.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    rec = verify(src, bad, tokenizer)
    assert rec["verdict"] == "FAIL" and rec["failures"][0].startswith("logits differ from the source checkpoint")


def _published(tmp_path):
    from pipeline.checkpoint.export import record_files
    from pipeline.common.io import write_json

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(os.urandom(4096))
    (hf / "config.json").write_text('{"model_type": "llama"}')
    files = record_files(hf)
    write_json(hf / "verification.json", {"verdict": "PASS"})
    write_json(hf / "pipeline_export.json", {"weights": {"model.safetensors": 4096}, "files": files})
    return hf


def test_an_export_overwritten_in_place_is_not_trusted(tmp_path):
    """model.safetensors overwritten with 0xFF bytes of the same size was "already exported and verified" (item 8)."""
    from pipeline.checkpoint.export import published_export

    hf = _published(tmp_path)
    assert published_export(hf) == {"verdict": "PASS"}
    os.utime(hf / "model.safetensors", ns=(1, 1))  # touched, same bytes: the digest is re-checked and matches
    assert published_export(hf) == {"verdict": "PASS"}
    (hf / "model.safetensors").write_bytes(b"\xff" * 4096)
    assert published_export(hf) is None
    (tmp_path / "b").mkdir()
    hf2 = _published(tmp_path / "b")
    (hf2 / "config.json").write_text('{"model_type": "gpt2"}')  # same size class, other content
    assert published_export(hf2) is None


def test_upload_all_poll_names_an_incomplete_final_iteration(tmp_path, caplog):
    """upload-all --poll said "every complete iteration is converted", "converted 0, failed none" when the tracked
    final iteration was incomplete (item 9)."""
    from pipeline.checkpoint.poll import upload_all
    from pipeline.common import layout

    ckpt = tmp_path / "checkpoints"
    half = ckpt / "iter_0000020"  # a Megatron save cut short: metadata, no shards
    half.mkdir(parents=True)
    (half / "metadata.json").write_text("{}")
    (half / "common.pt").write_bytes(b"")
    layout.write_tracker(ckpt, 20)
    (ckpt / layout.TRAINING_DONE).write_text("done\n")
    conv, failed = upload_all(ckpt, lambda p: {"verdict": "PASS"}, poll=True, interval=0.01)
    assert conv == [] and failed == [20]
    assert "names iteration 20, but iter_0000020 is incomplete: it was not converted" in caplog.text
    assert "every complete iteration is converted" not in caplog.text


def test_1e_3_is_a_number_in_configs_as_on_the_command_line(tmp_path):
    """YAML 1.1 reads 1e-3 as a string: `lr: 1e-3` in a config and `optimizer.lr=1e-3` as an override differed."""
    from pipeline.config.loader import read_yaml

    cfg = tmp_path / "c.yaml"
    cfg.write_text("optimizer:\n  lr: 1e-3\n  min_lr: 3E-5\nlogger:\n  wandb_exp_name: \"1e-3\"\n")
    data = read_yaml(cfg)
    assert data["optimizer"] == {"lr": 0.001, "min_lr": 3e-05} and data["logger"]["wandb_exp_name"] == "1e-3"


def test_terminal_escapes_in_a_reply_are_written_escaped():
    """An endpoint reply's terminal escapes were written raw into coherence_endpoint.md (item 15)."""
    from pipeline.coherence.run import markdown

    row = {"prompt": "hi", "response": "ok \x1b]0;pwned\x07\x1b[2J done", "response_length": 5, "empty": False,
           "truncated": False, "repetitive": False, "template_leak": None}
    report = {"time": "t", "prompts": ["hi"], "results": [{"model": "m\x1b[31m", "backend": "endpoint",
                                                            "summary": {"num_prompts": 1}, "rows": [row]}]}
    text = markdown(report)
    assert "\x1b" not in text and "\x07" not in text
    assert "ok \\x1b]0;pwned\\x07\\x1b[2J done" in text and "## m\\x1b[31m (endpoint)" in text


# ---- sbatch: an unreadable sbatch --help still knows which options take a value --------------------------------
@pytest.mark.parametrize("argv, script, opt", [
    (["--tmp", "10G", "job.sbatch", "a"], "job.sbatch", "--tmp=10G"),
    (["--gpus-per-task", "1", "job.sbatch"], "job.sbatch", "--gpus-per-task=1"),
    (["-M", "c1", "job.sbatch"], "job.sbatch", "-M"),
    (["--newer-option=x", "job.sbatch"], "job.sbatch", "--newer-option=x"),
])
def test_a_failing_sbatch_help_uses_the_built_in_table(tmp_path, monkeypatch, argv, script, opt):
    from pipeline.cli import sbatch as sbatch_cli
    from pipeline.slurm import sbatch_options

    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 1\n")  # --help and --usage print nothing
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("BAD_NODES_LOG", str(tmp_path / "bad.log"))
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    sbatch_options.sbatch_option_table.cache_clear()
    try:
        assert sbatch_options.sbatch_option_table() is None
        cmd, _, _ = sbatch_cli.build_submission(argv)
        assert script in cmd and cmd[cmd.index(script) - (2 if opt == "-M" else 1)] == opt
        with pytest.raises(UserError, match="sbatch --help could not be read; write it --opt=value"):
            sbatch_cli.build_submission(["--newer-option", "x", "job.sbatch"])
    finally:
        sbatch_options.sbatch_option_table.cache_clear()


def test_an_empty_response_to_a_prompt_that_fills_the_context_names_its_length(tmp_path, smollm2_dir, capsys):
    """A 9000-token prompt (SmolLM2's context is 8192) came back empty and was blamed on the chat template."""
    from pipeline.coherence.run import CoherenceRun
    from pipeline.coherence.run import run as coherence_run

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\n" + "word " * 9000 + "\n")
    rc = coherence_run(CoherenceRun(model=str(smollm2_dir), prompts=prompts, max_tokens=2, no_wandb=True,
                                    output_dir=tmp_path / "out", quiet=True))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1 and re.fullmatch(r"error: 1 empty response\(s\): prompt 2 is 9\d{3} tokens, which fills the "
                                    r"model's context of 8192 \(shorten it\)", err), err
    rows = read_json(tmp_path / "out" / "coherence_hf.json")["results"][0]["rows"]
    assert rows[1]["context_full"] and rows[1]["truncated"] and not rows[0]["context_full"]
