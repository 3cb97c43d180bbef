"""Chat template rendering and assistant-only loss masks.

The character spans of the assistant turns (their content plus the end-of-turn token that follows, so the model
learns to stop) are located by the template's structure: the conversation is rendered with each reply replaced by a
marker (:func:`locate_spans`). For a template that never inspects a reply's text (:func:`reply_blind`, decided once
per template) the real text is that render with the replies put back, one render per conversation
(:func:`substitute_spans`); otherwise the conversation is rendered a second time, as it is. The batch is then
tokenised in one call of the fast tokenizer, and the tokens from the one covering a span's first character to the
one covering its last get loss. Which token covers a character comes from the tokens' byte lengths where the
tokenizer keeps the text's bytes (:func:`token_byte_lengths`; the batch is then encoded without offsets), else from
the encodings' offsets.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import itertools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.common.errors import UserError
from pipeline.common.io import write_json
from pipeline.common.paths import cache_dir
from pipeline.config.models import REGISTRY, tokenizer_path
from pipeline.data.sources import loads

ENCODE_SUB_BATCH = 2048


def load_tokenizer(name_or_path: str | Path):
    """A Hugging Face fast tokenizer from a registry model name, a local directory or a hub id."""
    from transformers import AutoTokenizer

    spec = REGISTRY.get(str(name_or_path))
    path: str | Path
    if spec is not None and spec.trains_on.ships_models:
        path = tokenizer_path(spec)
    elif spec is not None:
        path = spec.hf_id
    else:
        path = name_or_path
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # any failure to load is the user's to fix (path, cache, hub)
        hint = ""
        if os.environ.get("HF_HUB_OFFLINE") == "1" and not Path(str(path)).exists():
            home = os.environ.get("HF_HOME", "~/.cache/huggingface")
            hint = (f"; {path} is not in the Hugging Face cache (HF_HOME={home})"
                    " and the Hub is off (HF_HUB_OFFLINE=1): run once with HF_HUB_OFFLINE=0 where the Hub is "
                    "reachable, or pass --tokenizer with a local tokenizer directory")
        raise UserError(f"cannot load tokenizer '{name_or_path}': {str(exc).splitlines()[0][:200]}{hint}") from None
    if not tok.is_fast:
        raise UserError(f"tokenizer '{name_or_path}' is not a fast tokenizer (offsets are needed for loss masks)")
    if tok.chat_template is None:
        raise UserError(f"tokenizer '{name_or_path}' has no chat template")
    return tok


def tokenizer_model_name(name_or_path: str | Path) -> str:
    """Name used in packed paths, as Megatron Bridge derives it: ``hf_org/hf_model`` -> ``hf_org--hf_model``."""
    spec = REGISTRY.get(str(name_or_path))
    if spec is not None:
        if spec.tokenizer_from:  # tiny models borrow another model's tokenizer
            spec = REGISTRY[spec.tokenizer_from]
        return spec.hf_id.replace("/", "--")
    p = Path(name_or_path)
    if p.exists():
        return p.resolve().name
    return str(name_or_path).replace("/", "--")


def _template(tokenizer):
    """The tokenizer's chat template compiled once (:func:`compile_template`), or None to fall back."""
    cached = getattr(tokenizer, "_pipeline_compiled_template", None)
    if cached is None:
        try:
            cached = compile_template(tokenizer.chat_template)
        except Exception:  # any problem: use apply_chat_template per conversation
            cached = False
        tokenizer._pipeline_compiled_template = cached
    return cached or None


@functools.lru_cache(maxsize=8)
def compile_template(chat_template: str):
    """A chat template compiled with jinja2 exactly as transformers (5.x, ``_cached_compile_jinja_template``)
    compiles it: an immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension
    and a ``{% generation %}`` block that renders its body, the ``tojson`` filter without HTML escaping, and the
    globals ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``. Importing transformers for this
    costs ~0.6 s per process; jinja2 alone a few milliseconds. Whether the result renders what
    ``apply_chat_template`` renders is checked once per run (:func:`template_matches_transformers`)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):  # transformers' AssistantTracker with its tracker never active
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation_support(self, context, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(chat_template)


def render_direct(template, messages: list[dict[str, Any]], special: dict) -> str:
    """What ``apply_chat_template(messages, tokenize=False)`` passes to its compiled template."""
    return template.render(messages=messages, tools=None, documents=None, add_generation_prompt=False, **special)


def template_errors() -> tuple[type[BaseException], ...]:
    """What a chat template raises when it refuses a conversation: its own ``raise_exception`` (a Gemma-style
    "System role not supported", a Mistral-style alternation check) is jinja2's TemplateError; transformers adds
    ValueError / TypeError for shapes it rejects. A refused conversation is dropped and counted, never fatal."""
    import jinja2

    return (jinja2.exceptions.TemplateError, ValueError, TypeError)


def template_matches_transformers(chat_template: str, special: dict, messages: list[dict[str, Any]]) -> bool | None:
    """The one-time check: the direct render of ``messages`` equals transformers' own rendering function
    (``render_jinja_template``, what ``apply_chat_template(tokenize=False)`` calls) with the same special tokens.
    None when both refuse the conversation (the template does not take that shape: no evidence either way); a
    refusal by one of the two only is a mismatch. Imports only ``transformers.utils.chat_template_utils`` (~0.6 s,
    no torch); run in a worker. The verdict is a function of its inputs, this module and the transformers and jinja2
    versions: it is kept per machine under ``<cache_dir>/template_checks/`` keyed by their hash, so a later run on
    the same template and versions skips the import (the import was ~4% of the stage's time at 2 workers)."""
    key = _check_key(chat_template, special, messages)
    path = _check_path(key) if key else None
    if path is not None:
        try:
            return json.loads(path.read_text(encoding="utf-8"))["matches"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    verdict = _template_matches_transformers(chat_template, special, messages)
    if path is not None:
        try:
            write_json(path, {"matches": verdict})
        except OSError:  # a read-only cache: checked again next time
            pass
    return verdict


def _check_key(chat_template: str, special: dict, messages: list[dict[str, Any]]) -> str | None:
    try:
        versions = [metadata.version("transformers"), metadata.version("jinja2")]
        code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    except (metadata.PackageNotFoundError, OSError):
        return None
    blob = json.dumps([chat_template, special, messages, versions, code], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _check_path(key: str) -> Path | None:
    try:
        return cache_dir() / "template_checks" / f"{key}.json"
    except (OSError, ValueError):
        return None


def _template_matches_transformers(chat_template: str, special: dict, messages: list[dict[str, Any]]) -> bool | None:
    from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

    errors = template_errors()
    try:
        theirs = render_jinja_template(conversations=[_normalize_chat_messages(messages)],
                                       chat_template=chat_template, add_generation_prompt=False, **special)[0][0]
    except errors:
        theirs = None
    try:
        ours = render_direct(compile_template(chat_template), messages, special)
    except errors:
        ours = None
    if theirs is None and ours is None:
        return None
    return ours == theirs


def tokenizer_files(name_or_path: str | Path) -> dict | None:
    """What the tokenize stage needs from a tokenizer, read from its files without transformers (~0.1 s instead of
    ~3 s): ``tokenizer_file`` (the Rust tokenizer's JSON), ``chat_template``, ``special`` (the special tokens map
    transformers builds from ``tokenizer_config.json``), ``eos`` and ``eos_id``. None when the tokenizer is not a
    local directory in the plain layout (``tokenizer.json``, ``tokenizer_config.json`` with string special tokens,
    ``chat_template.jinja`` or a string ``chat_template``, no legacy ``special_tokens_map.json``): then the caller
    loads the full tokenizer (:func:`load_tokenizer`)."""

    spec = REGISTRY.get(str(name_or_path))
    try:
        if spec is not None:
            if not spec.trains_on.ships_models:
                return None
            path = tokenizer_path(spec)
        else:
            path = Path(name_or_path)
        cfg = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        tpl_file = path / "chat_template.jinja"
        template = tpl_file.read_text(encoding="utf-8") if tpl_file.exists() else cfg.get("chat_template")
        if (not (path / "tokenizer.json").exists() or (path / "special_tokens_map.json").exists()
                or not isinstance(template, str) or cfg.get("backend", "tokenizers") != "tokenizers"
                or any(k in cfg for k in ("additional_special_tokens", "extra_special_tokens", "chat_control_tokens"))):
            return None
        special = {}
        for key in SPECIAL_TOKEN_KEYS:
            value = cfg.get(key)
            if value is None:
                continue
            if not isinstance(value, str):
                return None
            special[key] = value
        eos = special.get("eos_token")
        if eos is None:
            return None
        from tokenizers import Tokenizer

        eos_id = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(eos)
        if eos_id is None:
            return None
    except (OSError, ValueError, UserError):
        return None
    return {"tokenizer_file": str(path / "tokenizer.json"), "chat_template": template, "special": special,
            "eos": eos, "eos_id": int(eos_id)}


SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def render_text(tokenizer, messages: list[dict[str, Any]], special: dict | None = None) -> str:
    tpl = _template(tokenizer)
    if tpl is not None:
        return render_direct(tpl, messages, tokenizer.special_tokens_map if special is None else special)
    return tokenizer.apply_chat_template(messages, tokenize=False)


def render(tokenizer, messages: list[dict[str, Any]], special: dict | None = None
           ) -> tuple[str, list[tuple[int, int]]] | None:
    """Rendered text and assistant character spans; None when a turn cannot be located exactly."""
    def fn(msgs):
        return render_text(tokenizer, msgs, special)

    return locate_spans(fn(messages), messages, tokenizer.eos_token or "", fn)


class ChatEncoder:
    """What rendering, encoding and masking need from a tokenizer, in a form a worker process rebuilds in a
    fraction of a second (the Rust tokenizer from its JSON file or string, the chat template compiled with jinja2
    as transformers compiles it, :func:`compile_template`) without importing transformers.

    Made from a loaded tokenizer (:meth:`from_tokenizer`, which checks the direct render against
    ``apply_chat_template`` on one conversation) or from the tokenizer's files (:meth:`from_files`, no
    transformers at all; the caller then runs :func:`template_matches_transformers` once, in a worker).
    ``template`` is None when the direct render differs: then the full tokenizer ``hf`` renders each
    conversation, and a worker loads it by ``name``.
    """

    def __init__(self, backend, template, special: dict, eos: str, hf=None, name: str | None = None,
                 chat_template: str | None = None, tokenizer_file: str | None = None, eos_id: int | None = None):
        self.backend, self.template, self.special, self.eos = backend, template, special, eos
        self.hf, self.name, self.tokenizer_file = hf, name, tokenizer_file
        self.chat_template = chat_template if chat_template is not None else getattr(hf, "chat_template", None)
        self.eos_id = eos_id if eos_id is not None else getattr(hf, "eos_token_id", None)
        self._special_texts: list[str] | None = None
        self._reply_blind: bool | None = None
        self._special_firsts: str | None = None
        self._token_bytes: np.ndarray | None | bool = False  # False: not decided yet (:meth:`token_bytes`)

    @classmethod
    def from_tokenizer(cls, tokenizer, check: list[dict] | None = None, name: str | None = None) -> ChatEncoder:
        """``check``: one conversation's messages, rendered both ways to decide whether the direct render is exact."""
        template = _template(tokenizer)
        special = tokenizer.special_tokens_map  # computed per access in transformers: once here
        if template is not None and check is not None:
            try:
                same = render_direct(template, check, special) == tokenizer.apply_chat_template(check, tokenize=False)
            except template_errors():  # the template refuses this conversation: no evidence, so transformers renders
                same = False
            if not same:
                template = None
        return cls(tokenizer.backend_tokenizer, template, special, tokenizer.eos_token or "", hf=tokenizer, name=name)

    @classmethod
    def from_files(cls, files: dict, name: str | None = None) -> ChatEncoder:
        """From :func:`tokenizer_files`' record (the template check is the caller's to run)."""
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(files["tokenizer_file"]), compile_template(files["chat_template"]),
                   files["special"], files["eos"], name=name, chat_template=files["chat_template"],
                   tokenizer_file=files["tokenizer_file"], eos_id=files["eos_id"])

    def payload(self) -> dict:
        """Everything a worker process needs to rebuild this encoder (picklable, no tokenizer object)."""
        src = ({"tokenizer_file": self.tokenizer_file} if self.tokenizer_file
               else {"tokenizer_json": self.backend.to_str()})
        return {**src, "chat_template": self.chat_template, "direct": self.template is not None,
                "special": self.special, "eos": self.eos, "name": self.name}

    @staticmethod
    def files_payload(files: dict, name: str | None = None) -> dict:
        """:meth:`payload` of ``from_files(files, name)``, without building it here (workers start sooner)."""
        return {"tokenizer_file": files["tokenizer_file"], "chat_template": files["chat_template"], "direct": True,
                "special": files["special"], "eos": files["eos"], "name": name}

    @classmethod
    def from_payload(cls, p: dict) -> ChatEncoder:
        from tokenizers import Tokenizer

        if not p["direct"]:  # the template needs transformers' own apply_chat_template: load the real tokenizer
            return cls.from_tokenizer(load_tokenizer(p["name"]), name=p["name"])._without_direct()
        backend = (Tokenizer.from_file(p["tokenizer_file"]) if p.get("tokenizer_file")
                   else Tokenizer.from_str(p["tokenizer_json"]))
        return cls(backend, compile_template(p["chat_template"]), p["special"], p["eos"], name=p["name"],
                   chat_template=p["chat_template"], tokenizer_file=p.get("tokenizer_file"))

    def _without_direct(self) -> ChatEncoder:
        self.template = None
        return self

    def render_text(self, messages: list[dict[str, Any]]) -> str:
        if self.template is not None:
            return render_direct(self.template, messages, self.special)
        return self.hf.apply_chat_template(messages, tokenize=False)

    def render(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]] | None:
        """Rendered text and assistant character spans (None: the conversation cannot be located exactly). For a
        template that never inspects a reply's text (:func:`reply_blind`) one render, with markers in place of the
        replies, gives both; otherwise, or where that render does not hold each marker once, two renders
        (:func:`locate_spans`). Both give the same result."""
        if self.reply_blind():
            located = substitute_spans(messages, self.eos, self.render_text)
            if located is not _UNDECIDED:
                return located
        return locate_spans(self.render_text(messages), messages, self.eos, self.render_text)

    def reply_blind(self) -> bool:
        """Whether this encoder's template is reply-blind (:func:`reply_blind`), decided once per template."""
        if self._reply_blind is None:
            key = hashlib.sha256(json.dumps([self.chat_template, self.template is not None, self.special, self.eos],
                                            sort_keys=True, default=str).encode()).hexdigest()
            if key not in _REPLY_BLIND:
                _REPLY_BLIND[key] = reply_blind(self.chat_template, self.render_text, self.eos)
            self._reply_blind = _REPLY_BLIND[key]
        return self._reply_blind

    def token_bytes(self) -> np.ndarray | None:
        """Each token id's length in bytes of the text it stands for, where the tokens' bytes are the text's bytes
        exactly (:func:`token_byte_lengths`): then a token's offsets follow from these lengths and the encoding need
        not track them. None otherwise. Decided once per encoder."""
        if self._token_bytes is False:
            self._token_bytes = token_byte_lengths(self.backend)
        return self._token_bytes

    def special_texts(self) -> list[str]:
        """The text of the tokenizer's special tokens (``<|im_end|>``, ``<|endoftext|>``, ...)."""
        if self._special_texts is None:
            try:
                added = self.backend.get_added_tokens_decoder().values()
            except AttributeError:
                added = []
            self._special_texts = sorted({t.content for t in added if t.special and t.content}, key=len, reverse=True)
        return self._special_texts

    def holds_special_text(self, messages: list[dict[str, Any]]) -> bool:
        """Whether a message's content holds a special token's text: the tokenizer would turn it into the real
        control token (a ``<|im_end|>`` typed in a reply ends the turn early, and is trained on)."""
        texts = self.special_texts()
        if not texts:
            return False
        contents = [m["content"] for m in messages if isinstance(m.get("content"), str)]
        if self._special_firsts is None:
            self._special_firsts = "".join(sorted({t[0] for t in texts}))
        # one search of the joined contents per first character (one, "<", for most tokenizers), then the texts
        joined = "\x00".join(contents)
        if not any(c in joined for c in self._special_firsts):
            return False
        return any(t in c for c in contents for t in texts)

    def encode(self, conversations: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
        """(flat int32 token ids, flat int8 unrolled loss mask, int64 per-conversation lengths, drops).

        ``drops`` counts the conversations left out, by reason (every key present): ``template_mismatch`` (a turn
        that cannot be located exactly), ``template_refused`` (the chat template raises on it), and
        ``special_token_text`` (content holding a special token's text, :meth:`holds_special_text`).

        Sub-batches of ENCODE_SUB_BATCH conversations: render sub-batch k+1 (Python) while the Rust tokenizer
        encodes sub-batch k (it releases the GIL), and turn each sub-batch into flat arrays before the next one,
        so no more than two sub-batches of encodings (which hold offsets and strings per token) are alive.
        """
        drops = dict.fromkeys(DROP_REASONS, 0)
        errors = template_errors()
        ids_parts, mask_parts, len_parts = [], [], []
        token_bytes = self.token_bytes()
        encode_batch = self.backend.encode_batch if token_bytes is None else self.backend.encode_batch_fast

        def finish(encs, texts, spans):
            lengths = np.fromiter((len(e) for e in encs), dtype=np.int64, count=len(encs))
            total = int(lengths.sum())
            ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), dtype=np.int32, count=total)
            mask = np.zeros(total, dtype=np.int8)
            if token_bytes is None:
                _mask_by_offsets(mask, encs, spans, lengths)
            else:
                _mask_by_bytes(mask, ids, token_bytes, texts, spans, lengths, self.backend)
            ids_parts.append(ids)
            mask_parts.append(mask)
            len_parts.append(lengths)

        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = None
            for start in range(0, len(conversations), ENCODE_SUB_BATCH):
                texts, spans = [], []
                for conv in conversations[start:start + ENCODE_SUB_BATCH]:
                    if self.holds_special_text(conv["messages"]):
                        drops["special_token_text"] += 1
                        continue
                    try:
                        r = self.render(conv["messages"])
                    except errors:
                        drops["template_refused"] += 1
                        continue
                    if r is None:
                        drops["template_mismatch"] += 1
                        continue
                    texts.append(r[0])
                    spans.append(r[1])
                if pending is not None:
                    finish(pending[0].result(), *pending[1:])
                pending = (pool.submit(encode_batch, texts, add_special_tokens=False), texts, spans) \
                    if texts else None
            if pending is not None:
                finish(pending[0].result(), *pending[1:])
        if not len_parts:
            return np.zeros(0, np.int32), np.zeros(0, np.int8), np.zeros(0, np.int64), drops
        return np.concatenate(ids_parts), np.concatenate(mask_parts), np.concatenate(len_parts), drops


def _mask_by_offsets(mask: np.ndarray, encs, spans, lengths: np.ndarray) -> None:
    """Loss on the tokens from the one covering each span's first character to the one covering its last, by the
    encodings' own offsets (``char_to_token``)."""
    off = 0
    for e, sp, n in zip(encs, spans, lengths.tolist(), strict=True):
        for a, b in sp:
            if b <= 0:  # an empty span at the very start: nothing to mask (char_to_token(-1) raises)
                continue
            lo = _char_to_token(e, a, +1)
            hi = _char_to_token(e, b - 1, -1)
            if lo is not None and hi is not None and hi >= lo:
                mask[off + lo: off + hi + 1] = 1
        off += n


def _byte_pos(text: str, pos: int) -> int:
    return pos if text.isascii() else len(text[:pos].encode("utf-8", "surrogatepass"))


def _mask_by_bytes(mask: np.ndarray, ids: np.ndarray, token_bytes: np.ndarray, texts: list[str], spans,
                   lengths: np.ndarray, backend) -> None:
    """:func:`_mask_by_offsets`' result without the offsets: the tokens' byte lengths laid end to end give each
    token's byte range, and the token covering a character is the first whose range holds the character's first
    byte (what ``char_to_token`` returns, the offsets being the characters a token's bytes touch). A conversation
    whose tokens' bytes do not add up to its text's is masked by its own offsets instead."""
    ends = np.cumsum(token_bytes[ids])  # the sub-batch's tokens' byte ends, laid end to end
    tok_edges = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=tok_edges[1:])
    byte_edges = np.concatenate([[0], ends])[tok_edges]  # each conversation's first byte in that layout
    wanted = np.fromiter((len(t) if t.isascii() else len(t.encode("utf-8", "surrogatepass")) for t in texts),
                         dtype=np.int64, count=len(texts))
    los, his = [], []
    for c, (text, sp) in enumerate(zip(texts, spans, strict=True)):
        if byte_edges[c + 1] - byte_edges[c] != wanted[c]:  # never for the tokenizers let through; checked anyway
            off = int(tok_edges[c])
            _mask_by_offsets(mask[off:off + int(lengths[c])], [backend.encode(text, add_special_tokens=False)],
                             [sp], lengths[c:c + 1])
            continue
        base = int(byte_edges[c])
        for a, b in sp:
            if b <= 0:  # as in _mask_by_offsets
                continue
            los.append(base + _byte_pos(text, a))
            his.append(base + _byte_pos(text, b - 1))
    if not los:
        return
    lo = np.searchsorted(ends, np.array(los, dtype=np.int64), side="right")
    hi = np.searchsorted(ends, np.array(his, dtype=np.int64), side="right")
    for a, b in zip(lo.tolist(), hi.tolist(), strict=True):
        if b >= a:
            mask[a:b + 1] = 1


def _byte_alphabet() -> dict[str, int]:
    """The byte-level pre-tokenizer's character for each byte (GPT-2's table, as the Rust ``ByteLevel`` has it),
    inverted: character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars = {b: b for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + n
            n += 1
    return {chr(c): b for b, c in chars.items()}


def _keeps_bytes(spec: dict) -> bool:
    """Whether a tokenizer.json's pipeline keeps the text's bytes, in order, as its tokens' bytes, with untrimmed
    offsets: no normalizer, no padding or truncation, a byte-level BPE (no byte fallback), splits that remove
    nothing, no prefix space, added tokens that swallow no whitespace, and no post-processor that trims offsets."""
    def pre_ok(p) -> bool:
        kind = p.get("type")
        if kind == "Sequence":
            return all(pre_ok(q) for q in p.get("pretokenizers", []))
        if kind == "ByteLevel":
            return not p.get("add_prefix_space", False)
        return kind == "Split" and p.get("behavior") != "Removed" or kind == "Digits"

    def post_ok(p) -> bool:
        if p is None:
            return True
        kind = p.get("type")
        if kind == "Sequence":
            return all(post_ok(q) for q in p.get("processors", []))
        if kind == "ByteLevel":
            return not p.get("trim_offsets", True)
        return kind == "TemplateProcessing"

    pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
    # padding and truncation act on a batch as a whole (left padding shifts a shorter text's tokens), which the
    # single-text checks cannot see
    return (spec.get("normalizer") is None and spec.get("padding") is None and spec.get("truncation") is None
            and model.get("type") == "BPE" and not model.get("byte_fallback")
            and pre_ok(pre) and "ByteLevel" in json.dumps(pre) and post_ok(spec.get("post_processor"))
            and not any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", [])))


# What :func:`token_byte_lengths` checks, character by character, against the tokenizer's own offsets: multi-byte
# characters at token edges, whitespace runs, special-token text, digits, template syntax.
BYTE_CHECK_TEXTS = ["<|im_start|>user\nSay \"hi\" & <b>bye</b> {{ x }}<|im_end|>\n<|im_start|>assistant\n hi\n\nbye "
                    "<|im_end|>\n", "é? 😀 日本語の文 \t\t  x\r\n 12345 6789 ﷽ e\u0301 a\u200db", "   ", "\n\n\n x"]


def token_byte_lengths(backend) -> np.ndarray | None:
    """Each token id's length in bytes, for a tokenizer whose pipeline keeps the text's bytes (:func:`_keeps_bytes`);
    None for any other, or where any token is not byte-level text, or where the lengths do not give the tokenizer's
    own ``char_to_token`` on every character of :data:`BYTE_CHECK_TEXTS` (then masks come from the offsets)."""
    try:
        spec = loads(backend.to_str().encode())
    except (AttributeError, ValueError):
        return None
    if not _keeps_bytes(spec) or not hasattr(backend, "encode_batch_fast"):
        return None
    vocab = spec["model"].get("vocab")
    if not isinstance(vocab, dict) or not set("".join(vocab)) <= _byte_alphabet().keys():
        return None
    lengths = np.full(backend.get_vocab_size(with_added_tokens=True), -1, dtype=np.int64)
    ids = np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))
    if len(ids) and (ids.min() < 0 or ids.max() >= len(lengths)):
        return None
    lengths[ids] = np.fromiter(map(len, vocab), dtype=np.int64, count=len(vocab))  # one byte per character
    for i, added in backend.get_added_tokens_decoder().items():
        lengths[i] = len(added.content.encode("utf-8"))
    if (lengths < 0).any():
        return None
    for text in BYTE_CHECK_TEXTS + [t.content for t in backend.get_added_tokens_decoder().values()][:64]:
        enc = backend.encode(text, add_special_tokens=False)
        if backend.encode_batch_fast([text], add_special_tokens=False)[0].ids != enc.ids:
            return None
        ends = np.cumsum(lengths[np.array(enc.ids, dtype=np.int64)])
        for pos in range(len(text)):
            got = int(np.searchsorted(ends, _byte_pos(text, pos), side="right"))
            if enc.char_to_token(pos) != (got if got < len(ends) else None):
                return None
    return lengths


# Why :meth:`ChatEncoder.encode` leaves a conversation out (counted as ``dropped_<reason>`` by the tokenize stage).
DROP_REASONS = ("template_mismatch", "template_refused", "special_token_text")


# Markers that stand for each assistant reply in the probe render: private-use characters, which no template
# rewrites and which real text does not hold (a conversation that does is dropped, never guessed at).
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"


def locate_spans(text: str, messages: list[dict[str, Any]], eot: str, render_fn
                 ) -> tuple[str, list[tuple[int, int]]] | None:
    """The assistant replies' character spans in ``text`` (the conversation rendered by ``render_fn``), located by
    the template's own structure, never by searching for the reply: the conversation is rendered once more with
    each reply replaced by a unique marker, and the template's text around the markers must be exactly ``text``'s
    around the replies. Each span is the reply plus ``eot`` where the template ends the turn with it.

    None - the conversation is dropped and counted - when the template does not render every reply verbatim in
    place (it strips or rewrites a reply, rewrites an earlier turn such as stripping past reasoning, or renders
    differently depending on the reply's text): a mask is never a guess. (Searching the rendered text put the
    loss of a one-letter reply such as "a" on the template's own "<|im_start|>assistant".)"""
    asst = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not asst:
        return text, []
    marks = {i: f"{_MARK_OPEN}{n}{_MARK_CLOSE}" for n, i in enumerate(asst)}
    if _MARK_OPEN in text or _MARK_CLOSE in text:
        return None
    try:
        probe = render_fn([{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)])
    except Exception:  # a template that refuses the probe (it inspects the reply) cannot be located by structure
        return None
    spans: list[tuple[int, int]] = []
    p = t = 0  # positions in the probe and in the text
    for i in asst:
        s = probe.find(marks[i], p)
        if s < 0:
            return None
        seg = probe[p:s]
        if not text.startswith(seg, t):
            return None
        t += len(seg)
        content = messages[i]["content"]
        if not isinstance(content, str) or not text.startswith(content, t):
            return None
        end = t + len(content)
        spans.append((t, end + len(eot) if eot and text.startswith(eot, end) else end))
        t, p = end, s + len(marks[i])
    if text[t:] != probe[p:]:
        return None
    return text, spans


# Reply-blind templates: one render per conversation, not two. Decided per template (cached by its hash and its
# special tokens, per process) by two tests that must both pass; a template failing either keeps the two renders.
_REPLY_BLIND: dict[str, bool] = {}
_UNDECIDED = object()  # substitute_spans: this conversation needs the two renders

# Replies a template that inspects or rewrites reply text renders differently from a marker: template syntax,
# whitespace at either end, empty, escapes, special-token-like and reasoning/tool-call text, a long reply.
BLIND_PROBE_REPLIES = ["a", "", " ", "\n", " lead", "trail ", "\n both \n", "{{ x }}", "{% if true %}y{% endif %}",
                       "<|im_end|>", "<|im_start|>assistant", "</s>", "<s>", "[INST]", "<think>r</think> answer",
                       "</think>", "<tool_call>{\"name\": \"f\"}</tool_call>", "\"quoted\" \\ back", "&lt;b&gt;",
                       "assistant", "user", "None", "0", "True", "é 😀 \u200b", "line\r\nbreak", "x" * 5000]


def reply_blind(chat_template: str | None, render_fn, eot: str) -> bool:
    """Whether a chat template never inspects the text of an assistant reply, so that the real render is the
    marker render with each marker replaced by its reply (:func:`substitute_spans`). Both must hold:

    - *by structure*: in the template's syntax tree, every read of a ``content`` field (``m.content``,
      ``m['content']``) is output as it is, alone or joined with ``+``/``~`` (no filter, test, comparison, method,
      ``{% set %}``, condition or loop over it), so the text cannot change what is rendered around it;
    - *by probes*: on conversations of every exported shape, with each of BLIND_PROBE_REPLIES as every reply, the
      one-render result (text and spans) equals the two-render one (:func:`locate_spans`), refusals included.

    The structure test catches what no finite probe set can (a check on some other word in a reply); the probes
    catch what the syntax tree hides (the whole message serialised by ``tojson``, a macro's body)."""
    if not chat_template:
        return False
    return _content_only_output(chat_template) and _probes_agree(render_fn, eot)


def _content_only_output(chat_template: str) -> bool:
    import jinja2
    from jinja2 import nodes

    try:
        tree = compile_template(chat_template).environment.parse(chat_template)
    except (jinja2.exceptions.TemplateError, TypeError, ValueError):
        return False

    def is_content(node) -> bool:
        return ((isinstance(node, nodes.Getattr) and node.attr == "content")
                or (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const)
                    and node.arg.value == "content"))

    def walk(node, ok: bool) -> bool:
        """``ok``: ``node``'s value goes straight into the output."""
        if is_content(node):
            return ok and walk(node.node, False)
        if isinstance(node, nodes.Output):
            return all(walk(child, not isinstance(child, nodes.TemplateData)) for child in node.nodes)
        if isinstance(node, (nodes.Add, nodes.Concat)):
            return all(walk(child, ok) for child in node.iter_child_nodes())
        if isinstance(node, nodes.Const) and node.value == "content":  # .get('content'), attribute='content', ...
            return False
        if isinstance(node, nodes.Getattr) and node.attr in ("items", "values"):  # a message's fields by iteration
            return False
        return all(walk(child, False) for child in node.iter_child_nodes())

    return walk(tree, False)


def _probes_agree(render_fn, eot: str) -> bool:
    shapes = [["user", "assistant"], ["system", "user", "assistant", "user", "assistant"],
              ["user", "assistant", "user", "assistant", "user", "assistant"]]
    errors = template_errors()

    def outcome(fn, msgs):
        try:
            return fn(msgs)
        except errors as exc:
            return type(exc)

    for shape in shapes:
        for n, reply in enumerate(BLIND_PROBE_REPLIES):
            other = f"{n}: {BLIND_PROBE_REPLIES[-n]}"  # the other turns hold the probe texts too
            msgs = [{"role": role, "content": reply if role == "assistant" else other} for role in shape]
            if len(shape) > 2:  # replies that differ from each other in one conversation
                msgs[-1] = {"role": "assistant", "content": BLIND_PROBE_REPLIES[(n + 7) % len(BLIND_PROBE_REPLIES)]}
            one = outcome(lambda m: substitute_spans(m, eot, render_fn), msgs)
            if one is _UNDECIDED:
                continue  # the conversation would take the two renders anyway
            if one != outcome(lambda m: locate_spans(render_fn(m), m, eot, render_fn), msgs):
                return False
    return True


def substitute_spans(messages: list[dict[str, Any]], eot: str, render_fn):
    """:func:`locate_spans`' result from one render, for a reply-blind template (:func:`reply_blind`): the
    conversation rendered with each reply replaced by its marker; the text is that render with each marker replaced
    by its reply, and each span is the reply (plus ``eot`` where the text continues with it). ``_UNDECIDED`` when the
    marker render raises or does not hold each marker exactly once, in order (the caller then renders twice)."""
    asst = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not asst or not all(isinstance(messages[i].get("content"), str) for i in asst):
        return _UNDECIDED
    marks = {i: f"{_MARK_OPEN}{n}{_MARK_CLOSE}" for n, i in enumerate(asst)}
    try:
        probe = render_fn([{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)])
    except Exception:  # the two renders decide (a refusal of the real render is counted as such)
        return _UNDECIDED
    if probe.count(_MARK_OPEN) != len(asst) or probe.count(_MARK_CLOSE) != len(asst):
        return _UNDECIDED
    pieces, ends = [], []
    p = t = 0  # positions in the probe and in the text
    for i in asst:
        s = probe.find(marks[i], p)
        if s < 0:
            return _UNDECIDED
        content = messages[i]["content"]
        pieces += [probe[p:s], content]
        t += s - p
        ends.append((t, t + len(content)))
        t, p = t + len(content), s + len(marks[i])
    pieces.append(probe[p:])
    text = "".join(pieces)
    if _MARK_OPEN in text or _MARK_CLOSE in text:  # a message holds the marker characters: never guessed
        return None
    return text, [(a, b + len(eot) if eot and text.startswith(eot, b) else b) for a, b in ends]


def tokenize_conversations(tokenizer, conversations: list[dict]) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """Token ids and (unrolled) loss masks for each conversation; returns also how many were left out (a template
    mismatch or refusal, special-token text: :meth:`ChatEncoder.encode`).

    Assistant spans are mapped to token positions with ``char_to_token`` instead of materialising every
    token's offsets. The tokenize stage uses :meth:`ChatEncoder.encode` (flat arrays) directly.
    """
    enc = ChatEncoder.from_tokenizer(tokenizer, conversations[0]["messages"] if conversations else None)
    flat_ids, flat_mask, lengths, drops = enc.encode(conversations)
    mismatched = sum(drops.values())
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids_out = [flat_ids[offsets[i]:offsets[i + 1]].astype(np.int64) for i in range(len(lengths))]
    mask_out = [flat_mask[offsets[i]:offsets[i + 1]] for i in range(len(lengths))]
    return ids_out, mask_out, mismatched


def _char_to_token(enc, pos: int, step: int) -> int | None:
    """Token index covering character ``pos``; if none does (e.g. a normalised-away space), walk ``step``."""
    for _ in range(8):
        t = enc.char_to_token(pos)
        if t is not None:
            return t
        pos += step
        if pos < 0:
            return None
    return None
