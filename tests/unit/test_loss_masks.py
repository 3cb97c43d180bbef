"""Loss masks located by the template's structure, not by searching for the reply (issue 22, item 1).

Searching the rendered text for each reply put the loss of a one-letter reply ("a") on the template's own
"<|im_start|>assistant"; 51 of 60 multiple-choice conversations trained on the wrong tokens while prepare said
"kept: 60". The spans now come from a second render with each reply replaced by a marker: the template's text around
the markers must equal the real render around the replies, or the conversation is dropped and counted.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.data import packed_parquet
from pipeline.data.chat import locate_spans, tokenize_conversations
from pipeline.data.prepare import PrepareOptions, prepare

# Replies that a search finds in the template first, or twice, or not as themselves.
# (A reply holding "<|im_end|>" itself is dropped and counted, decision 36: see the test after this one.)
HOSTILE_REPLIES = ["a", "b", "i", "m", "s", "t", "n", "e", "d", "c", "assistant", "im_end", "im_start", "user",
                   "system", "\n", " ", "   ", "\n\n", "You are", "a" * 3, "Hello.", "<", "|", ">"]


def conversation(reply: str, question: str = "Pick one: a, b, c or d?") -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]}


@pytest.mark.parametrize("reply", HOSTILE_REPLIES, ids=repr)
def test_each_reply_is_masked_as_itself(tokenizer, reply):
    ids, masks, mismatched = tokenize_conversations(tokenizer, [conversation(reply)])
    assert mismatched == 0
    masked = tokenizer.decode(ids[0][masks[0] == 1])
    if reply.strip():
        assert masked == reply + "<|im_end|>", (reply, masked)
    else:  # BPE merges the template's "\n" with a whitespace reply into one token; that token is the reply's first
        assert masked in (reply + "<|im_end|>", "\n" + reply + "<|im_end|>"), (reply, masked)
    # every masked token lies after the last "<|im_start|>assistant" of the render: the reply's own turn
    turn = int(np.flatnonzero(ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>"))[-1])
    assert np.flatnonzero(masks[0]).min() > turn + 1


@pytest.mark.parametrize("reply", ["<|im_end|>", "done<|im_end|>", "<|endoftext|>x"], ids=repr)
def test_a_reply_holding_special_token_text_is_dropped_not_trained_on(tokenizer, reply):
    """The tokenizer turns the text into the real control token: the reply's turn would end early (issue 34)."""
    ids, masks, dropped = tokenize_conversations(tokenizer, [conversation(reply), conversation("b")])
    assert dropped == 1 and len(ids) == 1
    assert tokenizer.decode(ids[0][masks[0] == 1]) == "b<|im_end|>"


def test_repeated_replies_and_a_reply_equal_to_the_question(tokenizer):
    conv = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "a"},
                         {"role": "user", "content": "a"}, {"role": "assistant", "content": "a"},
                         {"role": "user", "content": "b?"}, {"role": "assistant", "content": ""}]}
    ids, masks, mismatched = tokenize_conversations(tokenizer, [conv])
    assert mismatched == 0
    assert tokenizer.decode(ids[0][masks[0] == 1]) == "a<|im_end|>a<|im_end|><|im_end|>"


def test_the_old_search_would_have_been_wrong_here(tokenizer):
    """The regression the issue measured: a one-letter reply that the template's "assistant" also contains."""
    from pipeline.data.chat import render_text

    msgs = conversation("a")["messages"]
    text = render_text(tokenizer, msgs)
    cursor = text.index("Pick one: a, b, c or d?") + len("Pick one: a, b, c or d?")
    searched = text.find("a", cursor)  # the old rule: the first "a" after the previous turn
    located = locate_spans(text, msgs, "<|im_end|>", lambda m: render_text(tokenizer, m))
    assert located is not None
    (start, end), = located[1]
    assert text[start:end] == "a<|im_end|>" and searched < start  # the search landed inside "assistant"


def strip_reasoning_template(messages):
    """A template that rewrites earlier turns (drops past reasoning, as some reasoning models' templates do)."""
    out, last = [], max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    for i, m in enumerate(messages):
        c = m["content"]
        if m["role"] == "assistant" and i != last and "</think>" in c:
            c = c.split("</think>")[-1].lstrip()
        out.append(f"<{m['role']}>{c}</s>")
    return "".join(out)


def test_a_template_that_rewrites_a_turn_is_never_guessed():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>hm</think> yes"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "no"}]
    text = strip_reasoning_template(msgs)
    assert locate_spans(text, msgs, "</s>", strip_reasoning_template) is None
    # a template that keeps every turn verbatim is located exactly
    def verbatim(m):
        return "".join(f"<{x['role']}>{x['content']}</s>" for x in m)

    text, spans = locate_spans(verbatim(msgs), msgs, "</s>", verbatim)
    assert [text[a:b] for a, b in spans] == ["<think>hm</think> yes</s>", "no</s>"]
    # a reply that holds the marker characters is dropped, never guessed
    odd = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\ue0000\ue001"}]
    assert locate_spans(verbatim(odd), odd, "</s>", verbatim) is None


def test_multiple_choice_through_prepare_and_the_packed_parquet(tmp_path, tokenizer):
    """60 multiple-choice conversations (the issue's reproduction) through prepare: every packed segment's loss is on
    the reply and its <|im_end|>, read back from the packed Parquet (loss_mask rolled by one: mask[j] marks the
    target token j + 1). Bridge's own reader reads the same rows in the Bridge harness (test_bridge_harness)."""
    letters = "abcdeimstn"
    data = tmp_path / "mc.jsonl"
    rows = [conversation(letters[i % len(letters)], f"Question {i}: which letter?") for i in range(60)]
    rows.append(conversation("   "))  # empty after strip: dropped and counted at export, never trained on
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = prepare(PrepareOptions(dataset=str(data), dataset_root=tmp_path / "root", seq_length=256,
                                     val_fraction=0.0, quiet=True, workers=1))
    assert summary["export"]["dropped"] == {"empty_content": 1}
    assert summary["export"]["kept"] == 60 and summary["tokenize"]["train"]["dropped_template_mismatch"] == 0
    assert summary["tokenize"]["train"]["loss_tokens"] == 120  # each reply is one token, plus its <|im_end|>
    packed = packed_parquet.read(summary["pack"]["paths"]["train"])
    replies = []
    for row in packed:
        ids, mask, starts = row["input_ids"], row["loss_mask"], row["seq_start_id"] + [len(row["input_ids"])]
        for a, b in zip(starts[:-1], starts[1:]):
            seg, m = ids[a:b], mask[a:b]
            replies.append(tokenizer.decode([seg[j + 1] for j in range(len(seg) - 1) if m[j]]))
    assert len(replies) == 60
    assert sorted(replies) == sorted(f"{letters[i % len(letters)]}<|im_end|>" for i in range(60))


# ---- one render per conversation for a reply-blind template (issue 36) -------------------------------------------
def _encoder(tokenizer, chat_template=None):
    from pipeline.data.chat import ChatEncoder, compile_template

    if chat_template is None:
        return ChatEncoder.from_tokenizer(tokenizer, conversation("x")["messages"])
    return ChatEncoder(tokenizer.backend_tokenizer, compile_template(chat_template), tokenizer.special_tokens_map,
                       tokenizer.eos_token, chat_template=chat_template)


def _two_renders(enc, msgs):
    return locate_spans(enc.render_text(msgs), msgs, enc.eos, enc.render_text)


def _hostile_conversations():
    from pipeline.data.chat import BLIND_PROBE_REPLIES

    replies = HOSTILE_REPLIES + BLIND_PROBE_REPLIES + ["\ue0000\ue001", "\ue000", "x\ue001", "\t tab \t", "\n\nq"]
    convs = [conversation(r) for r in replies]
    convs += [{"messages": [{"role": "system", "content": "S."}, {"role": "user", "content": r},
                            {"role": "assistant", "content": r}, {"role": "user", "content": "again"},
                            {"role": "assistant", "content": replies[(i + 3) % len(replies)]}]}
              for i, r in enumerate(replies)]
    convs.append({"messages": [{"role": "user", "content": "only a question"}]})
    convs.append({"messages": [{"role": "user", "content": "\ue000"}, {"role": "assistant", "content": "a"}]})
    return convs


def test_smollm2_renders_once_and_locates_what_two_renders_locate(tokenizer, monkeypatch):
    """SmolLM2's template never inspects a reply: the real render is the marker render with the replies put back, so
    one render gives the text and spans two gave, on every hostile reply (template syntax, whitespace at the ends,
    empty, marker characters, special-token text); the encoded ids and masks are the same arrays."""
    enc = _encoder(tokenizer)
    assert enc.reply_blind()
    calls = []
    render_text = enc.render_text
    monkeypatch.setattr(enc, "render_text", lambda m: calls.append(1) or render_text(m))
    convs = _hostile_conversations()
    for conv in convs:
        msgs = conv["messages"]
        calls.clear()
        one = enc.render(msgs)
        renders = len(calls)
        assert one == _two_renders(enc, msgs), msgs
        held = any("\ue000" in m["content"] or "\ue001" in m["content"] for m in msgs)  # marker characters
        assert renders == 1 or held or not any(m["role"] == "assistant" for m in msgs), msgs
    fast = enc.encode(convs)
    two = _encoder(tokenizer)
    two._reply_blind = False
    slow = two.encode(convs)
    for a, b in zip(fast[:3], slow[:3], strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert fast[3] == slow[3] and fast[3]["template_mismatch"] >= 4  # the marker-holding conversations


SMOL_TURN = "{{'<|im_start|>' + message['role'] + '\n' + CONTENT + '<|im_end|>' + '\n'}}"


@pytest.mark.parametrize("content, why", [
    ("message['content'] | trim", "a filter on the reply"),
    ("(message['content'] if message['content'] else 'empty')", "a condition on the reply"),
    ("message.get('content')", "content read by a method"),
    ("message['content'].split('</think>')[-1]", "reasoning dropped"),
], ids=lambda x: x if " " in x else None)
def test_a_template_that_inspects_replies_keeps_two_renders(tokenizer, content, why):
    tpl = "{% for message in messages %}" + SMOL_TURN.replace("CONTENT", content) + "{% endfor %}"
    enc = _encoder(tokenizer, tpl)
    assert not enc.reply_blind(), why
    for conv in _hostile_conversations():
        assert enc.render(conv["messages"]) == _two_renders(enc, conv["messages"])


def test_the_probes_catch_what_the_syntax_tree_hides(tokenizer):
    """No read of a ``content`` field, yet the render depends on the reply's length: the probes see it."""
    from pipeline.data.chat import _content_only_output

    tpl = ("{% for message in messages %}" + SMOL_TURN.replace("CONTENT", "message['content']")
           + "{{ (message | tojson | length) % 2 }}{% endfor %}")
    assert _content_only_output(tpl)
    enc = _encoder(tokenizer, tpl)
    assert not enc.reply_blind()
    for conv in _hostile_conversations():
        assert enc.render(conv["messages"]) == _two_renders(enc, conv["messages"])


def test_prepare_is_byte_identical_with_one_render_and_with_two(tmp_path, monkeypatch):
    """The quickstart data through prepare: the same tokenized chunks, packed Parquet and metadata whether the
    template is rendered once (reply-blind, the default for SmolLM2) or twice per conversation."""
    pats = ["tokenized/*/*/chunk_*.parquet", "packed/*/*.parquet", "packed/*/*_metadata.jsonl"]

    def run(root):
        prepare(PrepareOptions(dataset="chatterbot-corpus", dataset_root=root, seq_length=256, quiet=True, workers=1))
        return {str(p.relative_to(root)): p.read_bytes() for pat in pats for p in sorted(root.glob(pat))}

    once = run(tmp_path / "once")
    monkeypatch.setattr("pipeline.data.chat._REPLY_BLIND", {})
    monkeypatch.setattr("pipeline.data.chat.reply_blind", lambda *a: False)
    twice = run(tmp_path / "twice")
    assert len(once) >= 3 and once == twice


# ---- masks from the tokens' byte lengths instead of the encodings' offsets (issue 36) ----------------------------
MULTILINGUAL_REPLIES = ["é", "😀", "😀x", "x😀", "日本語", "e\u0301", "a\u200db", "﷽", " é ", "\t😀\n", "١٢٣", "Ωmega",
                        "naïve café", "🇬🇧🇫🇷", "\r\n", "  two  ", "<b>é</b>"]


def _byte_and_offset_encoders(tokenizer):
    fast = _encoder(tokenizer)
    assert fast.token_bytes() is not None  # SmolLM2's byte-level BPE keeps the text's bytes
    slow = _encoder(tokenizer)
    slow._token_bytes = None  # what the encoder does for a tokenizer token_byte_lengths refuses
    return fast, slow


def test_masks_from_byte_lengths_are_the_masks_from_offsets(tokenizer):
    """The encoding without offsets (``encode_batch_fast``) and the tokens' byte lengths give the same ids and masks
    as ``encode_batch``'s offsets, on the hostile replies, multi-byte characters at the reply's edges, and whole
    multi-turn conversations; the same conversations dropped for the same reasons."""
    fast, slow = _byte_and_offset_encoders(tokenizer)
    convs = _hostile_conversations() + [conversation(r, q) for r in MULTILINGUAL_REPLIES
                                        for q in ("é?", "why 😀", "plain")]
    convs += [{"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b},
                            {"role": "user", "content": b}, {"role": "assistant", "content": a}]}
              for a, b in zip(MULTILINGUAL_REPLIES, MULTILINGUAL_REPLIES[::-1], strict=True)]
    a, b = fast.encode(convs), slow.encode(convs)
    for x, y in zip(a[:3], b[:3], strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert a[3] == b[3]
    assert int(a[1].sum()) > len(convs)  # masks were set, not two empty arrays


def test_a_conversation_whose_bytes_do_not_add_up_is_masked_by_its_offsets(tokenizer, monkeypatch):
    """The per-conversation check: where the tokens' byte lengths do not add up to the text's bytes (a tokenizer that
    passed the checks yet changes a text), that conversation is encoded again with offsets; the rest keep the fast
    path. Forced here by giving "😀"'s tokens a wrong length."""
    fast, slow = _byte_and_offset_encoders(tokenizer)
    table = fast.token_bytes().copy()
    for i in tokenizer.backend_tokenizer.encode("😀", add_special_tokens=False).ids:
        table[i] += 1
    fast._token_bytes = table
    encoded = []
    real = fast.backend.encode
    monkeypatch.setattr(fast, "backend", _Spy(fast.backend, encoded))
    convs = [conversation("plain"), conversation("😀 yes"), conversation("ok")]
    a, b = fast.encode(convs), slow.encode(convs)
    assert encoded == [real(fast.render(convs[1]["messages"])[0], add_special_tokens=False).ids]
    for x, y in zip(a[:3], b[:3], strict=True):
        assert np.array_equal(x, y)


class _Spy:
    """The Rust tokenizer, recording the ids of each single ``encode`` (the per-conversation fallback)."""

    def __init__(self, backend, calls):
        self._backend, self._calls = backend, calls

    def encode(self, text, **kw):
        enc = self._backend.encode(text, **kw)
        self._calls.append(enc.ids)
        return enc

    def __getattr__(self, name):
        return getattr(self._backend, name)


@pytest.mark.parametrize("change, why", [
    (lambda j: j.update(normalizer={"type": "NFC"}), "a normalizer rewrites the text"),
    (lambda j: j.update(post_processor={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                        "use_regex": True}), "a post-processor trims offsets"),
    (lambda j: j["pre_tokenizer"].update(add_prefix_space=True), "a prefix space is added"),
    (lambda j: j["added_tokens"][2].update(rstrip=True), "an added token swallows whitespace"),
    (lambda j: j.update(pre_tokenizer={"type": "Whitespace"}), "not byte-level"),
    (lambda j: j.update(padding={"strategy": "BatchLongest", "direction": "Left", "pad_to_multiple_of": None,
                                 "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}),
     "left padding shifts a shorter text's tokens in a batch"),
    (lambda j: j.update(truncation={"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}),
     "truncation cuts tokens"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_a_tokenizer_that_may_not_keep_the_bytes_uses_the_offsets(tokenizer, change, why):
    """token_byte_lengths refuses every pipeline that may change, add or trim the text's bytes (the encoder then masks
    by the offsets, as before), and accepts SmolLM2's own JSON unchanged."""
    from tokenizers import Tokenizer

    from pipeline.data.chat import token_byte_lengths

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    assert token_byte_lengths(Tokenizer.from_str(json.dumps(spec))) is not None
    change(spec)
    assert token_byte_lengths(Tokenizer.from_str(json.dumps(spec))) is None, why


def test_prepare_is_byte_identical_with_byte_lengths_and_with_offsets(tmp_path, monkeypatch):
    """The quickstart data through prepare (one worker, in this process, so the switch reaches it): the same tokenized
    chunks, packed Parquet and metadata whether masks come from the byte lengths (the default for SmolLM2) or from the
    offsets."""
    pats = ["tokenized/*/*/chunk_*.parquet", "packed/*/*.parquet", "packed/*/*_metadata.jsonl"]

    def run(root):
        prepare(PrepareOptions(dataset="chatterbot-corpus", dataset_root=root, seq_length=256, quiet=True, workers=1))
        return {str(p.relative_to(root)): p.read_bytes() for pat in pats for p in sorted(root.glob(pat))}

    fast = run(tmp_path / "fast")
    monkeypatch.setattr("pipeline.data.chat.token_byte_lengths", lambda backend: None)
    slow = run(tmp_path / "slow")
    assert len(fast) >= 3 and fast == slow


def test_an_empty_reply_at_the_start_of_the_text_masks_nothing_on_either_path(tokenizer):
    """A template that renders only the contents puts an empty first reply at character 0 with no end-of-turn after
    it: the span (0, 0). Both paths mask nothing (the offsets path raised on ``char_to_token(-1)``; the byte path
    masked the whole conversation, found by review)."""
    tpl = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast, slow = _encoder(tokenizer, tpl), _encoder(tokenizer, tpl)
    slow._token_bytes = None
    assert fast.token_bytes() is not None
    convs = [{"messages": [{"role": "assistant", "content": ""}, {"role": "user", "content": q}]}
             for q in ("héllo there friend", "hello there friend")]
    a, b = fast.encode(convs), slow.encode(convs)
    for x, y in zip(a[:3], b[:3], strict=True):
        assert np.array_equal(x, y)
    assert len(a[0]) > 0 and not a[1].any()
