from pipeline.coherence.metrics import repeated_ngram_fraction, score, summarize, template_leak
from pipeline.coherence.prompts import DEFAULT_PROMPTS, load_prompts


def test_metrics_catch_more_than_emptiness():
    loop = "the cat sat on the mat " * 20
    assert repeated_ngram_fraction(loop) > 0.8
    assert score(loop, 128, 128, False, False)["repetitive"]
    assert score("Paris.", 2, 128, True, False) == {
        "response_length": 6, "response_tokens": 2, "prompt_tokens": None, "context_full": False, "empty": False,
        "truncated": False, "repeated_4gram_fraction": 0.0, "repetitive": False, "template_leak": ""}
    assert score("a cut answer", 10, 128, False, False, 8182, 8192)["context_full"]  # the context ended it
    assert score("", 0, 64, True, False)["empty"]
    assert score("a long answer", 64, 64, False, False)["truncated"]
    assert "<|im_start|>" in template_leak("hi<|im_start|>user", False)
    assert "<think>" in template_leak("<think>hmm</think> ok", False)
    assert template_leak("<think>hmm</think> ok", True) == []
    assert "role header" in template_leak("Sure.\nassistant\nmore", False)


def test_summary_and_prompts(tmp_path):
    rows = [score("", 0, 8, True, False), score("ok", 1, 8, True, False)]
    s = summarize(rows)
    assert s["empty_pct"] == 50.0 and s["num_prompts"] == 2
    assert len(DEFAULT_PROMPTS) == 8 and len(set(DEFAULT_PROMPTS)) == 8
    f = tmp_path / "p.txt"
    f.write_text("one\n\ntwo\n")
    assert load_prompts(f) == ["one", "two"]


def test_a_bom_is_not_part_of_the_first_prompt(tmp_path):
    """Issue 50 item 10: a UTF-8 BOM at the start of a prompt file was sent as part of the first prompt (and a .json
    file with one was refused as invalid JSON)."""
    from pipeline.coherence.prompts import load_prompts

    for name, body in (("p.txt", "Hello there\nSecond\n"), ("p.json", '["Hello there", "Second"]'),
                       ("p.jsonl", '"Hello there"\n"Second"\n')):
        f = tmp_path / name
        f.write_bytes(b"\xef\xbb\xbf" + body.encode())
        assert load_prompts(f) == ["Hello there", "Second"], name
