"""Worker processes for the tokenize stages: every core renders, encodes and masks its own share.

:class:`OrderedPool` runs a function over a stream of tasks in ``workers`` processes started with the
``spawn`` method (the Rust tokenizer's thread pool and ``fork`` do not mix) and yields the results in task
order, with at most ``2 * workers + 2`` tasks in flight, so memory stays bounded on a corpus of any size and
whatever consumes the results sees the same sequence whatever the number of workers. With one worker the
tasks run in the calling process (no start-up cost, and the caller's tokenizer is used as it is).

Each worker rebuilds its tokenizer from a small payload (the Rust tokenizer's JSON and the chat template,
see :class:`pipeline.data.chat.ChatEncoder`) instead of importing transformers' model stack; its Rust
thread pool gets ``usable CPUs // workers`` threads (one when the workers fill the machine). A worker dies
with its parent (``PR_SET_PDEATHSIG``), so a killed run leaves nothing writing behind it.

Task functions:
  - :func:`export_slice`: rows read from a byte range of a JSONL dataset file, normalised -> JSON lines.
  - :func:`chat_slice`: conversations read from a byte range of an exported JSONL split ->
    (flat int32 ids, flat int8 loss mask, int64 lengths, conversations dropped by reason).
  - :func:`template_check`: the one-time check that the direct chat-template render equals transformers'.
  - :func:`text_part`: pretraining documents -> one ``part_NNNNN.bin`` + ``.lens.npy`` written atomically.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from pipeline.common.errors import UserError
from pipeline.common.io import atomic_path
from pipeline.data import sources
from pipeline.data.chat import ChatEncoder, template_matches_transformers
from pipeline.data.sources import loads

WORKER_DIED = ("a tokenize worker process died (killed, or out of memory?); finished chunks are kept: re-run to "
               "resume, with fewer --workers if memory is short")
_STATE: dict = {}  # per process: the encoder (chat) or tokenizer + EOD (text) the task functions use


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a Slurm step's cores, not the whole node)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def resolve_workers(workers: int | None) -> int:
    """The worker count: every usable CPU by default; a request above the usable CPUs is capped there (each worker
    is a spawned process of 45-70 MB that only competes for the same cores: --workers 1000 exhausted a node)."""
    cpus = usable_cpus()
    if workers is None:
        return cpus
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UserError(f"--workers must be an integer >= 1, got {workers!r}")
    if workers > cpus:
        logging.getLogger(__name__).warning("--workers %d is more than the %d usable CPU(s) of this process; using %d",
                                            workers, cpus, cpus)
        return cpus
    return workers


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


def _worker_start(parent_pid: int, threads: int, init: Callable, initargs: tuple) -> None:
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)
    init(*initargs)


class OrderedPool:
    """``with OrderedPool(n, init, initargs) as pool: for r in pool.imap(fn, tasks): ...`` (see the module doc).

    ``init(*initargs)`` runs once in each worker process; with one worker it is not run (the caller has set up
    the in-process state with ``local``, a zero-argument callable run instead)."""

    def __init__(self, workers: int, init: Callable, initargs: tuple, local: Callable | None = None):
        self.workers = workers
        self._ex: ProcessPoolExecutor | None = None
        if workers > 1:
            threads = max(1, usable_cpus() // workers)
            self._ex = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                                           initializer=_worker_start, initargs=(os.getpid(), threads, init, initargs))
        elif local is not None:
            local()

    def start(self) -> OrderedPool:
        """Start every worker now (the executor starts one per submitted task), so their start-up overlaps
        whatever the caller does next (the export stage)."""
        if self._ex is not None:
            for _ in range(self.workers):
                self._ex.submit(_noop)
        return self

    def submit(self, fn: Callable, *args):
        """One task outside the ordered stream: a future (already done with one worker)."""
        if self._ex is not None:
            return self._submit(self._ex, fn, *args)

        fut: Future = Future()
        fut.set_result(fn(*args))
        return fut

    def result(self, fut):
        return self._result(fut)

    def imap(self, fn: Callable, tasks: Iterable) -> Iterator:
        ex = self._ex
        if ex is None:
            for t in tasks:
                yield fn(t)
            return
        pending: collections.deque = collections.deque()
        window = 2 * self.workers + 2
        for t in tasks:
            pending.append(self._submit(ex, fn, t))
            if len(pending) >= window:
                yield self._result(pending.popleft())
        while pending:
            yield self._result(pending.popleft())

    @staticmethod
    def _submit(ex: ProcessPoolExecutor, fn: Callable, *args) -> Future:
        try:
            return ex.submit(fn, *args)
        except BrokenProcessPool:  # a worker died before this task was handed out
            raise UserError(WORKER_DIED) from None

    @staticmethod
    def _result(fut):
        try:
            return fut.result()
        except BrokenProcessPool:
            raise UserError(WORKER_DIED) from None

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True, cancel_futures=True)
            self._ex = None

    def __enter__(self) -> OrderedPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _noop() -> None:
    return None


# ---- chat conversations (prepare's tokenize stage) -------------------------------------------------------
def init_chat(payload: dict) -> None:
    _STATE["chat"] = ChatEncoder.from_payload(payload)


def set_chat(encoder) -> None:
    _STATE["chat"] = encoder


def template_check(conversations: list[list[dict]]) -> bool:
    """The one-time check that this worker's direct render equals transformers' on every conversation given
    (see ``ChatEncoder.from_files``)."""
    enc = _STATE["chat"]
    if enc.template is None:
        return False
    verdicts = [template_matches_transformers(enc.chat_template, enc.special, m) for m in conversations]
    # a shape the template refuses both ways (a system turn for a Gemma-style template) proves nothing; at least
    # one shape must render, and identically
    return all(v is not False for v in verdicts) and any(verdicts)


def read_lines(path: Path, start: int, end: int) -> list[dict]:
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)

    return [loads(line) for line in data.split(b"\n") if line.strip()]


def export_slice(task: tuple) -> tuple[list[bytes], list[tuple[int, str]], int]:
    """The export stage's task: see :func:`pipeline.data.sources.export_slice`."""
    return sources.export_slice(*task)


def chat_slice(task: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    path, start, end = task
    return _STATE["chat"].encode(read_lines(path, start, end))


def line_starts(path: Path, block: int = 1 << 24) -> np.ndarray:
    """Byte offsets of the non-empty lines of a text file, plus its size at the end (vectorised, in blocks)."""
    starts, pos, prev = [], 0, 10  # a line starts after a newline; the file's first byte counts as after one
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        while True:
            buf = f.read(block)
            if not buf:
                break
            a = np.frombuffer(buf, dtype=np.uint8)
            after_nl = np.empty(len(a), dtype=bool)
            after_nl[0] = prev == 10
            after_nl[1:] = a[:-1] == 10
            starts.append(np.flatnonzero(after_nl & (a != 10)) + pos)
            prev, pos = int(a[-1]), pos + len(a)
    return np.concatenate([*starts, np.array([size], dtype=np.int64)]).astype(np.int64)


# ---- pretraining documents (the tokenize action) ---------------------------------------------------------
def init_text(tokenizer_json: str, eod: int, dtype: str) -> None:
    from tokenizers import Tokenizer

    set_text(Tokenizer.from_str(tokenizer_json), eod, dtype)


def set_text(backend, eod: int, dtype: str) -> None:
    _STATE["text"] = (backend, eod, np.dtype(dtype))


# A document longer than this is encoded in pieces of at most this many characters, cut after a newline (else a
# space), and the pieces' ids joined into the one document: the Rust tokenizer's encoding of a 24 MB document
# (offsets, strings and masks per token, for every thread) aborted tokenize with an out-of-memory error.
MAX_ENCODE_CHARS = 1 << 20


def _encode_batch(backend):
    """The Rust tokenizer's batch encoding without offsets (``encode_batch_fast``, the same ids; offsets are not
    needed for documents) where this tokenizers version has it."""
    return getattr(backend, "encode_batch_fast", backend.encode_batch)


def _pieces(text: str, bound: int | None = None) -> list[str]:
    bound = bound or MAX_ENCODE_CHARS
    out, i = [], 0
    while len(text) - i > bound:
        cut = text.rfind("\n", i, i + bound)
        if cut <= i:
            cut = text.rfind(" ", i, i + bound)
        cut = i + bound if cut <= i else cut + 1
        out.append(text[i:cut])
        i = cut
    out.append(text[i:])
    return out


def _encode_long(backend, text: str, dtype: np.dtype) -> np.ndarray:
    """One long document's ids, encoded piece by piece (one piece's encoding alive at a time)."""
    parts = []
    for piece in _pieces(text):
        ids = _encode_batch(backend)([piece], add_special_tokens=False)[0].ids
        parts.append(np.fromiter(ids, dtype=dtype, count=len(ids)))
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def encode_documents(backend, texts: list[str], eod: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Every non-empty document's ids followed by ``eod``, back to back; and the int32 sequence lengths. A document
    over MAX_ENCODE_CHARS is encoded in pieces (:func:`_encode_long`); the others in one batch."""
    long = {i for i, t in enumerate(texts) if len(t) > MAX_ENCODE_CHARS}
    if long:
        encs = _encode_batch(backend)(["" if i in long else t for i, t in enumerate(texts)], add_special_tokens=False)
        docs = [_encode_long(backend, texts[i], dtype) if i in long else np.fromiter(e.ids, dtype=dtype, count=len(e))
                for i, e in enumerate(encs)]
        docs = [d for d in docs if len(d)]
        lens = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
        out = np.concatenate([np.append(d, np.array([eod], dtype=dtype)) for d in docs]) if docs else \
            np.zeros(0, dtype)
        return out, lens.astype(np.int32)
    encs = _encode_batch(backend)(texts, add_special_tokens=False)
    lens = np.fromiter((len(e) for e in encs), dtype=np.int64, count=len(encs))
    lens = lens[lens > 0] + 1
    flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), dtype=dtype,
                       count=int(lens.sum()) - len(lens))
    out = np.empty(int(lens.sum()), dtype=dtype)
    ends = np.cumsum(lens) - 1
    is_eod = np.zeros(len(out), dtype=bool)
    is_eod[ends] = True
    out[ends] = eod
    out[~is_eod] = flat
    return out, lens.astype(np.int32)


def text_part(task: tuple) -> int:
    """Encode one part's documents and write ``part_bin`` and ``part_len`` atomically; returns the document count."""
    texts, part_bin, part_len = task
    backend, eod, dtype = _STATE["text"]
    tokens, lens = encode_documents(backend, texts, eod, dtype)
    with atomic_path(Path(part_bin)) as tmp:
        tokens.tofile(tmp)
    with atomic_path(Path(part_len)) as tmp, open(tmp, "wb") as f:
        np.save(f, lens)
    return len(texts)
