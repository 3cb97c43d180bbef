"""Load conversations from any supported source and normalise them to ``{"messages": [...]}``.

Sources: ``chatterbot-corpus`` (the packaged English chat corpus), a Hugging Face dataset name
(``org/name``; needs the hub or a warm cache), a local directory (saved ``datasets`` dataset, or a
folder of JSONL/Parquet files), a ``.jsonl`` file or a ``.parquet`` file.

Rows are accepted in the OpenAI ``messages`` shape (``role``/``content``) or ShareGPT's
``conversations`` shape (``from``/``value``). A row that cannot be used is counted under a reason and
skipped (an undecodable line counts as ``invalid_utf8``); the caller decides what to do when nothing is
left. A file that cannot be read at all (corrupt Parquet, no permission) is one ``UserError`` naming it.

``input_identity`` says what a dataset is, for the fingerprints that decide whether a stage is done.
"""

from __future__ import annotations

import collections
import fnmatch
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson
import yaml

from pipeline.common.errors import UserError, exc_line
from pipeline.data.shards import Shard, split_files

ROLE_ALIASES = {
    "system": "system", "user": "user", "assistant": "assistant",
    "human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant",
}
BUILTIN = ("chatterbot-corpus",)
# A conversation longer than this (8 Mi characters, ~2 Mi tokens of English: twice the longest --seq-length) is
# dropped at export as too_large: tokenizing costs a worker ~150 bytes of memory per character (a 45 MB message
# took 6 GB), so one such row could take a node's memory down, and packing could keep at most its first 1 Mi tokens.
MAX_CONVERSATION_CHARS = 1 << 23


def dataset_dirname(dataset: str) -> str:
    """``allenai/Dolci-Instruct-SFT`` -> ``allenai__Dolci-Instruct-SFT``; ``chatterbot-corpus`` as is; a local
    path -> its stem plus a short hash of its resolved path (``chat-1a2b3c4d``), so ``/a/chat.jsonl`` and
    ``/b/chat.jsonl`` never share a default data root."""
    if dataset in BUILTIN:
        return dataset
    p = Path(dataset)
    if p.exists():
        stem = p.name.split(".")[0] if p.is_file() else p.name
        digest = hashlib.sha256(str(p.resolve()).encode("utf-8", "surrogateescape")).hexdigest()[:8]
        return f"{stem or 'dataset'}-{digest}"
    return dataset.replace("/", "__")


def input_identity(dataset: str, exclude: Path | None = None, glob: str | None = None) -> dict:
    """What a dataset is, cheaply: path + size + mtime for a file; for a directory the same over its files
    (count, total size, newest mtime, and a hash of the listing: every file of a saved ``datasets`` folder, the data
    files of a plain one); the name (and package version) otherwise. ``exclude``: an output folder inside a saved
    dataset's folder, which is not part of the input; ``glob``: the files of a text corpus folder (see
    :func:`text_files`)."""
    if dataset in BUILTIN:
        try:
            version = metadata.version("chatterbot-corpus")
        except metadata.PackageNotFoundError:
            version = "unknown"
        return {"kind": "builtin", "name": dataset, "version": version}
    p = Path(dataset)
    try:
        if p.is_file():
            st = p.stat()
            return {"kind": "file", "path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if p.is_dir():
            skip = exclude.resolve() if exclude is not None else None
            h, n, size, mtime = hashlib.sha256(), 0, 0, 0
            walk: Iterable[tuple[str, list[str], list[str]]]
            if _is_saved_dataset(p):  # every file under it (but the output folder) is part of the dataset
                walk = os.walk(p)
            elif glob is not None or is_text_folder(p):  # a text corpus: exactly the files iter_texts reads
                walk = [(str(p), [], [str(f.relative_to(p)) for f in text_files(p, exclude, glob)])]
            else:  # a plain folder is exactly the data files the export reads (the output root may be the folder)
                walk = [(str(p), [], [f.name for f in _dir_files(p)])]
            for dirpath, dirnames, filenames in walk:
                dirnames[:] = sorted(d for d in dirnames if skip is None or Path(dirpath, d).resolve() != skip)
                for fn in sorted(filenames):
                    f = Path(dirpath, fn)
                    st = f.stat()
                    n, size, mtime = n + 1, size + st.st_size, max(mtime, st.st_mtime_ns)
                    h.update(f"{f.relative_to(p)}\t{st.st_size}\t{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
            return {"kind": "dir", "path": str(p.resolve()), "files": n, "size": size, "mtime_ns": mtime,
                    "listing": h.hexdigest()[:16]}
    except OSError as exc:
        raise UserError(f"cannot read dataset {dataset}: {exc.strerror or exc}") from None
    return {"kind": "hub", "name": dataset}


def _chatterbot_rows() -> Iterator[dict]:
    import chatterbot_corpus

    d = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    for f in sorted(d.glob("*.yml")):
        doc = yaml.safe_load(f.read_text(encoding="utf-8")) or {}
        for conv in doc.get("conversations") or []:
            msgs = []
            for i, turn in enumerate(conv):
                msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": turn})
            yield {"messages": msgs, "source": f"chatterbot/{f.stem}"}


def loads(raw: bytes) -> Any:
    """``json.loads`` of one JSON document, ~2x faster: orjson first, and the standard parser for what orjson
    refuses (NaN, a lone-surrogate escape, ...), with its error. One difference remains, harmless to a conversation
    (only its strings are used): an integer beyond 64 bits comes back as a float."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


BLANK = object()  # what _parse_line gives for a blank line (a JSON ``null`` line is a row: None, not_an_object)
_BOM = b"\xef\xbb\xbf"


def _parse_line(raw: bytes) -> Any:
    """One JSONL line's row; BLANK for a blank line; ``{"__bad__": reason}`` for one that cannot be read. A UTF-8
    byte-order mark (which editors put at the start of a file) is not part of the row."""
    if raw.startswith(_BOM):
        raw = raw[len(_BOM):]
    try:
        return orjson.loads(raw)  # the common case (see loads); anything it refuses is decided below as before
    except orjson.JSONDecodeError:
        pass
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return {"__bad__": "invalid_utf8"}
    if not line.strip():
        return BLANK
    try:
        return json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return {"__bad__": "invalid_json"}


def _jsonl_rows(path: Path) -> Iterator[dict]:
    try:
        with open(path, "rb") as f:
            for raw in f:
                row = _parse_line(raw)
                if row is not BLANK:
                    yield row
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()


def input_files(dataset: str) -> list[Path]:
    """The local files the export reads: the file itself, or a plain folder's data files; [] for a saved
    ``datasets`` folder, a hub id or the built-in corpus."""
    p = Path(dataset)
    if dataset in BUILTIN:
        return []
    if p.is_file():
        return [p]
    return _dir_files(p) if p.is_dir() and not _is_saved_dataset(p) else []


def unread_files(dataset: str) -> list[Path]:
    """A plain folder's ``.jsonl``/``.parquet`` entries that :func:`input_files` leaves out (said in the log)."""
    p = Path(dataset)
    if dataset in BUILTIN or not p.is_dir() or _is_saved_dataset(p):
        return []
    read = set(_dir_files(p))
    return sorted(f for f in [*p.glob("*.jsonl"), *p.glob("*.parquet")] if f not in read)


def jsonl_files(dataset: str) -> list[Path] | None:
    """The files of a dataset made of JSONL files only (a ``.jsonl``/``.json`` file, or a folder of them), which
    the export stage reads in parallel, a byte range per task; None for any other kind of dataset."""
    files = input_files(dataset)
    return files if files and all(f.suffix == ".jsonl" or f.name.endswith(".json") for f in files) else None


def export_line(conv: dict) -> bytes:
    """A normalised conversation as the export stage writes it (one JSONL line, compact UTF-8, no newline; its
    strings are valid Unicode, :func:`normalise` drops the rest)."""
    return orjson.dumps(conv)


def export_slice(path: Path, start: int, end: int) -> tuple[list[bytes], list[tuple[int, str]], int]:
    """The rows in bytes ``start:end`` of a JSONL file (whole lines), normalised as :func:`load_conversations`
    does: (the kept rows as :func:`export_line`, ``(row, reason)`` for each dropped row, the number of rows)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    kept, dropped, n = [], [], 0
    for raw in data.split(b"\n"):
        row = _parse_line(raw)
        if row is BLANK:
            continue
        normal = normalise(row)
        if normal[0] is None:
            dropped.append((n, normal[1]))
        else:
            kept.append(export_line(normal[0]))
        n += 1
    return kept, dropped, n


def _parquet_rows(path: Path) -> Iterator[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        batches = pf.iter_batches(batch_size=4096)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield from batch.to_pylist()
    except (pa.ArrowException, OSError) as exc:
        detail = exc_line(exc)
        raise UserError(f"{path} is not a readable Parquet file: {detail}") from None


def _dir_rows(path: Path) -> Iterator[dict]:
    if _is_saved_dataset(path):
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise UserError(f"{path} has a dataset_info.json or dataset_dict.json but is not a saved `datasets` "
                            f"dataset: {exc_line(exc)}") from None
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
        yield from ds
        return
    files = _dir_files(path)
    if not files:
        raise UserError(f"no .jsonl or .parquet files in {path}")
    for f in files:
        yield from _file_rows(f)


def _file_rows(f: Path) -> Iterator[dict]:
    return _parquet_rows(f) if f.suffix == ".parquet" else _jsonl_rows(f)


# A text corpus folder (no .jsonl/.parquet in it): its text files, recursively (tokenize DIR).
TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst", ".py", ".tex", ".org", ".adoc", ".html", ".c", ".h",
                 ".cpp", ".js", ".ts", ".java", ".go", ".rs", ".sh", ".yaml", ".yml", ".toml")


def is_text_folder(path: Path) -> bool:
    return path.is_dir() and not any(path.glob("*.jsonl")) and not any(path.glob("*.parquet"))


def text_files(path: Path, exclude: Path | None = None, glob: str | None = None) -> list[Path]:
    """The documents of a text corpus folder: regular files under it with a text suffix (``TEXT_SUFFIXES``) or,
    with ``glob``, whose path relative to the folder matches it (``fnmatch``: ``*`` crosses folders, so ``*.py``
    is every Python file and ``docs/*.md`` the Markdown under docs/), sorted, except those under ``exclude`` (an
    output folder inside it). One list for reading and for the fingerprint, so a changed corpus is always tokenized
    again (the fingerprint of a text folder used to cover no file at all)."""
    skip = exclude.resolve() if exclude is not None else None
    out = []
    for f in sorted(path.rglob("*")):
        chosen = fnmatch.fnmatchcase(str(f.relative_to(path)), glob) if glob is not None else \
            f.suffix.lower() in TEXT_SUFFIXES
        if chosen and f.is_file() and not f.is_symlink() and \
                (skip is None or skip not in f.resolve().parents):
            out.append(f)
    return out


def is_binary(head: bytes) -> bool:
    """A file that holds NUL bytes in its first 8 KiB is not text (a binary named .txt is skipped and counted)."""
    return b"\0" in head


def _dir_files(path: Path) -> list[Path]:
    """The data files of a plain folder: its ``.jsonl`` and ``.parquet`` regular files (a FIFO would block), except
    an earlier export's ``training.*``/``validation.*``/``test.*`` unless there is nothing else."""
    files = sorted(f for f in [*path.glob("*.jsonl"), *path.glob("*.parquet")] if f.is_file())
    return [f for f in files if not f.name.startswith(("training.", "validation.", "test."))] or files


def _hub_rows(name: str, split: str) -> Iterator[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as exc:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise UserError(
            f"cannot load dataset '{name}' split '{split}' from the Hugging Face hub"
            + (" (HF_HUB_OFFLINE=1 and it is not in the cache)" if offline else "")
            + f": {str(exc).splitlines()[0][:200]}"
        ) from None
    yield from ds


def iter_raw_rows(dataset: str, split: str = "train") -> Iterator[dict]:
    if dataset in BUILTIN:
        return _chatterbot_rows()
    p = Path(dataset)
    if p.is_dir():
        return _dir_rows(p)
    if p.is_file():
        if p.suffix == ".jsonl" or p.name.endswith(".json"):
            return _jsonl_rows(p)
        if p.suffix == ".parquet":
            return _parquet_rows(p)
        raise UserError(f"unsupported dataset file {p} (expected .jsonl or .parquet)")
    if "/" in dataset and not dataset.startswith((".", "/")) and dataset.count("/") == 1 and not dataset.endswith(
            (".jsonl", ".json", ".parquet")):
        return _hub_rows(dataset, split)
    raise UserError(f"dataset '{dataset}' not found: not a file, a directory, an org/name id, or one of {BUILTIN}")


def normalise(row: Any) -> tuple[dict, None] | tuple[None, str]:
    """Return (``{"messages": [...]}``, None) or (None, reason)."""
    if not isinstance(row, dict):
        return None, "not_an_object"
    if "__bad__" in row:
        return None, row["__bad__"]
    msgs = row.get("messages")
    if msgs is None:
        msgs = row.get("conversations")
    if msgs is None:
        return None, "missing_messages"
    if not isinstance(msgs, list) or not msgs:
        return None, "empty_conversation"
    out, chars = [], 0
    for m in msgs:
        if not isinstance(m, dict):
            return None, "bad_message"
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        role = ROLE_ALIASES.get(str(role).lower()) if role is not None else None
        if role is None:
            return None, "bad_role"
        if not isinstance(content, str):
            return None, "bad_content"
        if not content.strip():
            return None, "empty_content"
        if not content.isascii():  # a lone surrogate (a "\ud800" escape) is no text a tokenizer can encode
            try:
                content.encode("utf-8")
            except UnicodeEncodeError:
                return None, "invalid_unicode"
        chars += len(content)
        out.append({"role": role, "content": content})
    if chars > MAX_CONVERSATION_CHARS:
        return None, "too_large"
    if not any(m["role"] == "assistant" for m in out):
        return None, "no_assistant_turn"
    if out[-1]["role"] != "assistant":
        out = out[: max(i for i, m in enumerate(out) if m["role"] == "assistant") + 1]
    return {"messages": out}, None


def load_conversations(dataset: str, split: str = "train", limit: int | None = None,
                       ) -> tuple[list[dict], collections.Counter]:
    """All usable conversations plus a Counter of dropped rows by reason (and 'rows_in')."""
    stats: collections.Counter = collections.Counter()
    convs = []
    for row in iter_raw_rows(dataset, split):
        stats["rows_in"] += 1
        conv, reason = normalise(row)
        if conv is None:
            stats[f"dropped_{reason}"] += 1
            continue
        convs.append(conv)
        if limit and len(convs) >= limit:
            break
    return convs, stats


def corpus_files(dataset: str, exclude: Path | None = None, glob: str | None = None) -> list[Path] | None:
    """The files a pretraining corpus is read from, in the order :func:`iter_texts` reads them: a text folder's text
    files (or those ``glob`` matches), a plain folder's ``.jsonl``/``.parquet`` files, or the file itself. None for a
    corpus that is not local files (a hub id, a saved ``datasets`` folder, the built-in corpus)."""
    p = Path(dataset)
    if dataset in BUILTIN:
        return None
    if glob is not None or is_text_folder(p):
        return text_files(p, exclude, glob)
    if p.is_file():
        return [p] if p.suffix in (".jsonl", ".parquet") or p.name.endswith(".json") else None
    return _dir_files(p) if p.is_dir() and not _is_saved_dataset(p) else None


def corpus_shards(dataset: str, out_dir: Path, glob: str | None, count: int) -> list[Shard]:
    """The corpus's files split into ``count`` shards (:func:`shards.split_files`); a corpus that is not local data
    files cannot be split (one line)."""
    files = corpus_files(dataset, exclude=out_dir, glob=glob)
    if files is None:
        raise UserError(f"corpus '{dataset}' is not local data files (a hub id, a saved datasets folder, the built-in "
                        "corpus or a file of another kind), so it cannot be split into shards: tokenize it on one node")
    return split_files(files, count)


def iter_texts(dataset: str, field: str = "text", split: str = "train", exclude: Path | None = None,
               glob: str | None = None, counts: dict | None = None,
               files: Iterable[Path] | None = None) -> Iterable[str]:
    """Documents of a pretraining corpus: rows with a ``text`` field, or the text files of a folder
    (:func:`text_files`, or those ``glob`` matches; ``exclude``: an output folder inside it). Binary files (NUL
    bytes) and files that are not UTF-8 (a Latin-1 corpus: decoding with replacement turned every accented letter
    into U+FFFD, silently) are skipped, logged and counted in ``counts`` (``skipped_binary_files``,
    ``skipped_non_utf8_files``). ``files``: read only these of the corpus's files (:func:`corpus_files`, a shard's
    run of them), in their order."""
    p = Path(dataset)
    if glob is not None and not p.is_dir():
        raise UserError(f"--glob chooses the files of a corpus folder, and {dataset} is not a folder")
    if glob is not None or is_text_folder(p):
        binary, not_utf8 = 0, []
        for f in (text_files(p, exclude, glob) if files is None else files):
            data = f.read_bytes()
            if is_binary(data[:8192]):
                binary += 1
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                not_utf8.append(f)
                continue
            yield text
        log = logging.getLogger(__name__)
        if binary:
            log.warning("%s: skipped %d binary file(s) (NUL bytes) among the text files", dataset, binary)
        if not_utf8:
            log.warning("%s: skipped %d file(s) that are not UTF-8 (first: %s); convert them, e.g. iconv -f latin1 "
                        "-t utf-8", dataset, len(not_utf8), not_utf8[0])
        if counts is not None:
            counts["skipped_binary_files"] = binary
            counts["skipped_non_utf8_files"] = len(not_utf8)
        return
    rows = iter_raw_rows(dataset, split) if files is None else (r for f in files for r in _file_rows(f))
    for row in rows:
        if isinstance(row, dict) and isinstance(row.get(field), str):
            yield row[field]
