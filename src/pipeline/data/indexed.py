"""The ``tokenize`` action: a pretraining corpus -> Megatron indexed dataset (``.bin`` + ``.idx``).

Format (``megatron.core.datasets.indexed_dataset``, MMIDIDX version 1): ``.bin`` holds the token ids
back to back (uint16 when the vocabulary is below 65500, else int32, as Megatron's
``DType.optimal_dtype`` chooses); ``.idx`` holds the header, the dtype code, sequence and document
counts, int32 sequence lengths, int64 byte pointers and int64 document indices. Every document is one
sequence ending in the tokenizer's EOD token, as ``preprocess_data.py --append-eod`` writes.

Resumable: documents are tokenised in parts written atomically under ``.parts/``; a re-run skips
finished parts, and the final ``.bin``/``.idx``/``token_count.json`` are assembled atomically from the
parts, so an interrupted run and an uninterrupted run produce byte-identical files. ``token_count.json``
records a fingerprint (the corpus's identity: path, size, mtime over its files; the tokenizer and every
option): a rerun with a different fingerprint redoes the work, naming the difference, and parts are reused
only when ``.parts/_FINGERPRINT.json`` matches. One run per output folder at a time (``.tokenize.lock``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.common.errors import UserError
from pipeline.common.io import atomic_path, write_json
from pipeline.common.locks import exclusive_lock
from pipeline.common.log import Progress
from pipeline.data import workers as wk
from pipeline.data.chat import load_tokenizer
from pipeline.data.fingerprint import fingerprint_diff, read_marker, reuse_if_current
from pipeline.data.shards import LIMIT_NOT_SHARDABLE, SHARDS_DIR, check_count, ranges, shard_dir
from pipeline.data.sources import corpus_shards, input_identity, iter_texts

log = logging.getLogger(__name__)
INDEX_HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}


def optimal_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def write_index(path: Path, dtype: np.dtype, lengths: np.ndarray) -> None:
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    doc_idx = np.arange(len(lengths) + 1, dtype=np.int64)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(INDEX_HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", DTYPE_CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))


def read_index(path: Path) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype, sequence lengths, pointers, document indices) - used by tests and the token counter."""
    buf = Path(path).read_bytes()
    if buf[:9] != INDEX_HEADER:
        raise ValueError(f"{path}: not a Megatron index file")
    code = buf[17]
    dtype = {v: k for k, v in DTYPE_CODES.items()}[code]
    n_seq, n_doc = struct.unpack_from("<QQ", buf, 18)
    off = 34
    lengths = np.frombuffer(buf, np.int32, n_seq, off)
    off += 4 * n_seq
    pointers = np.frombuffer(buf, np.int64, n_seq, off)
    off += 8 * n_seq
    docs = np.frombuffer(buf, np.int64, n_doc, off)
    return dtype, lengths, pointers, docs


_OUTPUT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_OUTPUT_NAME = 200  # bytes: + "_text_document.idx" and a temporary's suffix stay under NAME_MAX (255)


def _with(prefix: Path, ext: str) -> Path:
    """``PREFIX.bin`` / ``PREFIX.idx``: appended, never ``with_suffix`` (a name with a dot, ``corpus.v2``, lost
    its ``.v2_text_document`` and wrote ``corpus.bin``)."""
    return prefix.with_name(prefix.name + ext)


def check_output_name(output_name: str) -> None:
    """OUTPUT_NAME is a file name inside the output folder, never a path (``../../escape`` wrote outside it)."""
    if isinstance(output_name, str) and len(output_name.encode()) > MAX_OUTPUT_NAME:  # a longer file name fails
        raise UserError(f"output name {output_name[:40]!r}... has {len(output_name.encode())} bytes, more than "
                        f"{MAX_OUTPUT_NAME}: the files <name>_text_document.bin/.idx must fit a file name (255 bytes)")
    if not isinstance(output_name, str) or not _OUTPUT_NAME.match(output_name) or output_name in (".", ".."):
        raise UserError(f"output name {output_name!r} must be a file name (letters, digits, '.', '_', '-'; starting "
                        "with a letter or digit), not a path: the files are written to OUTPUT_DIR/<name>_text_document"
                        ".bin/.idx")


def tokenize_corpus(source: str, tokenizer_name: str, out_dir: Path, output_name: str, *,
                    text_field: str = "text", docs_per_part: int = 2000, limit: int | None = None,
                    force: bool = False, quiet: bool = False, workers: int | None = None, glob: str | None = None,
                    shard: tuple[int, int] | None = None) -> dict:
    """``workers``: processes that encode parts (default every usable CPU); the files do not depend on it.
    ``glob``: the files of a corpus folder to read (default: every file with a common text suffix). ``shard``:
    (I, N) tokenizes only shard I of N (``data/shards.py``) into its own folder; :func:`merge_shards` then writes the
    output, byte for byte what one run without ``shard`` writes."""
    check_output_name(output_name)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output {out_dir} exists and is not a directory")
    if glob is not None and not Path(source).is_dir():
        raise UserError(f"--glob chooses the files of a corpus folder, and {source} is not a folder")
    fp = _fingerprint(source, tokenizer_name, out_dir, text_field=text_field, docs_per_part=docs_per_part,
                      limit=limit, glob=glob)
    kw: dict[str, Any] = {"text_field": text_field, "docs_per_part": docs_per_part, "limit": limit, "force": force,
                          "quiet": quiet, "workers": workers, "glob": glob}
    if shard is None:
        with exclusive_lock(out_dir / ".tokenize.lock", f"output folder {out_dir}"):
            return _tokenize_locked(source, tokenizer_name, out_dir, output_name, fp, **kw)
    index, count = shard
    if limit:
        raise UserError(LIMIT_NOT_SHARDABLE)
    piece = corpus_shards(source, out_dir, glob, count)[index]
    where = shard_dir(out_dir, index, count)
    where.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(where / ".tokenize.lock", f"shard folder {where}"):
        return _tokenize_locked(source, tokenizer_name, where, output_name, {**fp, "shard": [index, count]},
                                files=piece.files, **kw)


def _fingerprint(source: str, tokenizer_name: str, out_dir: Path, *, text_field, docs_per_part, limit, glob) -> dict:
    return {"input": input_identity(source, exclude=out_dir, glob=glob), "tokenizer": tokenizer_name,
            "text_field": text_field, "docs_per_part": docs_per_part, "limit": limit, "glob": glob}


def _tokenize_locked(source, tokenizer_name, out_dir: Path, output_name: str, fp: dict, *, text_field, docs_per_part,
                     limit, force, quiet, workers, glob, files: tuple[Path, ...] | None = None) -> dict:
    """Tokenize into ``out_dir`` (resumable, see the module docstring); ``files``: a shard's run of the corpus's
    files, which may hold no document (the other shards do)."""
    prefix = out_dir / f"{output_name}_text_document"
    count_path = out_dir / "token_count.json"
    finished = all(p.exists() for p in (count_path, _with(prefix, ".bin"), _with(prefix, ".idx")))
    if not force and finished:
        old = reuse_if_current(count_path, fp, "tokenize", prefix)
        if old is not None:
            return old
    parts_dir = out_dir / ".parts"
    started = parts_dir / "_FINGERPRINT.json"
    if parts_dir.exists() and (force or fingerprint_diff((read_marker(started) or {}).get("fingerprint"), fp)):
        shutil.rmtree(parts_dir)  # parts of another input or options: never mixed into this output
    if not started.exists():
        write_json(started, {"fingerprint": fp})
    tok = load_tokenizer(tokenizer_name)
    eod = tok.eos_token_id
    if eod is None:
        raise UserError(f"tokenizer '{tokenizer_name}' has no EOS token to separate documents")
    dtype = optimal_dtype(len(tok))
    skipped: dict = {}
    texts = iter_texts(source, field=text_field, exclude=out_dir, glob=glob, counts=skipped, files=files)
    if limit:
        texts = itertools.islice(texts, limit)
    workers = wk.resolve_workers(workers)
    n_parts = reused = 0

    def tasks(bar):  # the parts still to do, read in order by this process; parts on disk are only counted
        nonlocal n_parts, reused
        while True:
            batch = list(itertools.islice(texts, docs_per_part))
            if not batch:
                return
            part_bin, part_len = parts_dir / f"part_{n_parts:05d}.bin", parts_dir / f"part_{n_parts:05d}.lens.npy"
            n_parts += 1
            if part_bin.exists() and part_len.exists():
                reused += 1
                bar.update(len(batch))
            else:
                yield batch, str(part_bin), str(part_len)

    with Progress("tokenize", unit="doc", quiet=quiet, logger=log) as bar:
        todo = tasks(bar)
        head = list(itertools.islice(todo, 2))  # a corpus of one part to do is not worth starting processes for
        workers = workers if len(head) > 1 else 1
        payload = (tok.backend_tokenizer.to_str(), int(eod), dtype.name) if workers > 1 else ()
        with wk.OrderedPool(workers, wk.init_text, payload,
                            local=lambda: wk.set_text(tok.backend_tokenizer, int(eod), dtype.name)) as pool:
            for n_docs in pool.imap(wk.text_part, itertools.chain(head, todo)):
                bar.update(n_docs)
    part = n_parts
    if reused:
        log.info("tokenize: resumed: %d of %d parts were already on disk in %s (only the others were tokenized)",
                 reused, part, parts_dir)
    if part == 0 and files is None:
        raise _no_documents(source, text_field, glob)
    lengths = []
    with atomic_path(_with(prefix, ".bin")) as tmp, open(tmp, "wb") as out:
        for p in range(part):
            with open(parts_dir / f"part_{p:05d}.bin", "rb") as f:
                shutil.copyfileobj(f, out, 1 << 24)
            lengths.append(np.load(parts_dir / f"part_{p:05d}.lens.npy"))
    lengths_arr = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
    write_index(_with(prefix, ".idx"), dtype, lengths_arr)
    result = {"documents": int(len(lengths_arr)), "tokens": int(lengths_arr.sum()),
              "tokens_without_eod": int(lengths_arr.sum() - len(lengths_arr)), "dtype": dtype.name,
              "eod_id": int(eod), "tokenizer": tokenizer_name, "prefix": str(prefix), **skipped, "fingerprint": fp}
    write_json(count_path, result)
    shutil.rmtree(parts_dir)  # also removes temporaries a killed run left behind
    log.info("tokenize: %d documents, %d tokens -> %s.{bin,idx} (count in %s)", result["documents"],
             result["tokens"], prefix, count_path)
    return result


def _no_documents(source: str, text_field: str, glob: str | None) -> UserError:
    chat = Path(source).is_dir() and (Path(source) / "training.jsonl").exists()
    hint = (f"; {source} looks like a prepared chat dataset (training.jsonl with 'messages'): tokenize makes a "
            "pretraining corpus from text; for SFT data use prepare (or pack)") if chat else ""
    if glob is not None:
        hint += f" (the files --glob {glob!r} matches)"
    return UserError(f"corpus '{source}' has no documents (field '{text_field}'){hint}")


def merge_shards(source: str, tokenizer_name: str, out_dir: Path, output_name: str, count: int, *,
                 text_field: str = "text", docs_per_part: int = 2000, glob: str | None = None, force: bool = False
                 ) -> dict:
    """The output of ``count`` finished shards (``tokenize_corpus(shard=(I, count))`` for every I, with the same
    input and options): their ``.bin`` files one after another and their sequence lengths joined, as
    megatron-core's ``IndexedDatasetBuilder.add_index`` merges indexed datasets, and ``token_count.json`` summed:
    byte for byte what one run writes. Refused, naming them, while any shard is unfinished or was made from another
    input or options. The shard folders are removed once the output is written."""
    check_output_name(output_name)
    check_count(count)
    out_dir = Path(out_dir)
    fp = _fingerprint(source, tokenizer_name, out_dir, text_field=text_field, docs_per_part=docs_per_part,
                      limit=None, glob=glob)
    with exclusive_lock(out_dir / ".tokenize.lock", f"output folder {out_dir}"):
        prefix = out_dir / f"{output_name}_text_document"
        count_path = out_dir / "token_count.json"
        if not force and all(p.exists() for p in (count_path, _with(prefix, ".bin"), _with(prefix, ".idx"))):
            old = reuse_if_current(count_path, fp, "tokenize (merge)", prefix)
            if old is not None:
                return old
        shards = [_finished_shard(out_dir, output_name, i, count, fp) for i in range(count)]
        unfinished = [i for i, rec in enumerate(shards) if rec is None]
        if unfinished:
            raise UserError(f"cannot merge {count} shards into {prefix}: shard(s) {ranges(unfinished)} are not "
                            f"finished (or were made from another input or options): run tokenize --shard I/{count} "
                            "for each, then merge")
        records = [rec for rec in shards if rec is not None]
        if len({(r["dtype"], r["eod_id"]) for r in records}) > 1:
            raise UserError(f"the shards in {out_dir / SHARDS_DIR} disagree on the token dtype or EOD id: "
                            "tokenize them again (--force)")
        if sum(r["documents"] for r in records) == 0:
            raise _no_documents(source, text_field, glob)
        lengths = []
        with atomic_path(_with(prefix, ".bin")) as tmp, open(tmp, "wb") as out:
            for rec in records:
                shard_prefix = Path(rec["prefix"])
                with open(_with(shard_prefix, ".bin"), "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
                lengths.append(read_index(_with(shard_prefix, ".idx"))[1])
        dtype = np.dtype(records[0]["dtype"])
        lengths_arr = np.concatenate(lengths)
        write_index(_with(prefix, ".idx"), dtype, lengths_arr)
        skipped = {k: sum(int(r.get(k, 0)) for r in records) for k in records[0] if k.startswith("skipped_")}
        result = {"documents": int(len(lengths_arr)), "tokens": int(lengths_arr.sum()),
                  "tokens_without_eod": int(lengths_arr.sum() - len(lengths_arr)), "dtype": dtype.name,
                  "eod_id": records[0]["eod_id"], "tokenizer": tokenizer_name, "prefix": str(prefix), **skipped,
                  "fingerprint": fp}
        write_json(count_path, result)
        for i in range(count):  # this split's shards only: another split's may still be running
            shutil.rmtree(shard_dir(out_dir, i, count))
        with contextlib.suppress(OSError):
            (out_dir / SHARDS_DIR).rmdir()  # when no other split's shards are left in it
    log.info("tokenize: merged %d shards: %d documents, %d tokens -> %s.{bin,idx}", count, result["documents"],
             result["tokens"], prefix)
    return result


def _finished_shard(out_dir: Path, output_name: str, index: int, count: int, fp: dict) -> dict | None:
    """A shard's record when it finished from this input and these options, with its files present; else None."""
    where = shard_dir(out_dir, index, count)
    rec = read_marker(where / "token_count.json")
    prefix = where / f"{output_name}_text_document"
    if rec is None or fingerprint_diff(rec.get("fingerprint"), {**fp, "shard": [index, count]}) \
            or Path(rec.get("prefix", "")) != prefix \
            or not all(p.is_file() for p in (_with(prefix, ".bin"), _with(prefix, ".idx"))):
        return None
    return rec
