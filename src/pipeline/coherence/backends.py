"""Generation backends. Each returns, per prompt, (text, generated token count, finished-by-itself[, prompt token
count, the model's context length]); the last two, where a backend knows them, name a prompt that filled the context.

  hf        transformers: a local HF directory or a hub id; greedy decoding with the model's chat template
  endpoint  an already running OpenAI-compatible server (plain HTTP from the standard library)
  megatron  a Megatron checkpoint directly, on GPUs (pipeline/bridge.py; one rank per GPU under torchrun)
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.common.eos import end_ids
from pipeline.common.errors import UserError
from pipeline.config.models import spec_for

log = logging.getLogger(__name__)
Generation = tuple  # (str, int, bool) or (str, int, bool, int | None, int | None)


@dataclass(frozen=True)
class Backend:
    """A generation backend as an object: what the coherence command and its plan ask of it, answered once here
    instead of by comparing its name where it is asked (as ``config/engines.py`` does for the training engines)."""

    name: str
    reads_hf: bool  # its models (and --compare's) are Hugging Face folders or hub ids, generated with transformers
    reads_checkpoint: bool  # its model is a Megatron checkpoint root or iteration (--iteration, --hf-model)
    model_parallel: bool  # it takes a Megatron layout (--tp/--pp/--ep), one rank per GPU under torchrun
    remote: bool  # an already running server generates: no model files, no GPU of the job's own

    def __str__(self) -> str:
        return self.name


HF = Backend("hf", reads_hf=True, reads_checkpoint=False, model_parallel=False, remote=False)
ENDPOINT = Backend("endpoint", reads_hf=False, reads_checkpoint=False, model_parallel=False, remote=True)
MEGATRON = Backend("megatron", reads_hf=False, reads_checkpoint=True, model_parallel=True, remote=False)
BY_NAME = {b.name: b for b in (HF, ENDPOINT, MEGATRON)}
NAMES = tuple(BY_NAME)


def backend(name: str) -> Backend:
    """The backend called ``name`` (``--backend``); an unknown one is one line."""
    found = BY_NAME.get(name)
    if found is None:
        raise UserError(f"unknown backend {name!r} (one of {', '.join(NAMES)})")
    return found


def hf_generate(model_path: str, prompts: list[str], max_tokens: int, reasoning: bool) -> list[Generation]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(model_path)
    if not p.exists() and ("/" not in model_path or model_path.startswith((".", "/"))):
        raise UserError(f"model {model_path} does not exist (a local HF directory or a hub id ORG/NAME)")
    if p.is_dir():
        tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        missing = [what for what, names in (("config.json", ("config.json",)),
                                             ("tokenizer files (tokenizer.json, tokenizer_config.json)",
                                              tokenizer_files))
                   if not any((p / n).is_file() for n in names)]
        if missing:
            raise UserError(f"{model_path} is not a Hugging Face model folder: it has no {' and no '.join(missing)} "
                            "(an export's hf/ folder has both; a Megatron checkpoint needs --backend megatron)")
    spread = spread_over_gpus(model_path)
    try:
        tok = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32,
            **({"device_map": "auto"} if spread else {}))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UserError(f"cannot load model {model_path}: {(str(exc).splitlines() or [type(exc).__name__])[0][:200]}"
                        ) from None
    if not tok.chat_template:
        raise UserError(f"the tokenizer of {model_path} has no chat template: the coherence prompts are chat turns "
                        "(export with the model's tokenizer files, or add chat_template.jinja)")
    if spread:  # accelerate placed the layers over the node's GPUs; inputs go to the first one
        device = model.device
        log.info("hf backend: %s spread over %d GPUs (device_map='auto')", model_path, torch.cuda.device_count())
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model.to(device)
    model.eval()
    eos = end_ids(model_path, tok)  # the megatron backend's end ids too (pipeline.common.eos)
    context = getattr(model.config, "max_position_embeddings", None)
    out = []
    for prompt in prompts:
        msgs = [{"role": "user", "content": prompt}]
        kwargs = {"enable_thinking": reasoning} if tok.chat_template and "enable_thinking" in tok.chat_template else {}
        try:
            enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                          **kwargs)
        except Exception as exc:  # jinja2's TemplateError (raise_exception), or the template's own bug
            raise UserError(f"the chat template of {model_path} refuses the coherence prompts (one user turn): "
                            f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}") from None
        n_prompt = int(enc["input_ids"].shape[1])
        room = max_tokens if not context else min(max_tokens, context - n_prompt)
        if room < 1:  # the prompt alone fills the context: nothing to generate, and the report says why
            out.append(("", 0, False, n_prompt, context))
            continue
        enc = {k: v.to(device) for k, v in enc.items()}
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=room, do_sample=False, eos_token_id=sorted(eos) or None,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        new = gen[0, n_prompt:].tolist()
        finished = bool(new) and new[-1] in eos
        text = tok.decode(new, skip_special_tokens=True).strip()
        out.append((text, len(new), finished, n_prompt, context))
    return out


def model_bytes(model_path: str) -> float | None:
    """The BF16 size of a model: a local folder's safetensors, else the registry's parameter count."""
    p = Path(model_path)
    if p.is_dir():
        size = sum(f.stat().st_size for f in p.glob("*.safetensors"))
        if size:
            return float(size)
    spec = spec_for(model_path)
    return 2e9 * spec.total_params_b if spec is not None and spec.total_params_b else None


def spread_over_gpus(model_path: str, margin: float = 0.85) -> bool:
    """Whether the hf backend loads the model over the node's GPUs: more than one GPU here, and the weights do not
    fit ``margin`` of one GPU's memory (Super's 240 GB on 95 GB GPUs; the plan says the same at submission)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return False
    need = model_bytes(model_path)
    return need is None or need > margin * torch.cuda.get_device_properties(0).total_memory


def discovery_file_problem(path: Path) -> str | None:
    """Why ``path`` is not a serving job's discovery file to read now (a directory, or absent), else None."""
    if path.is_dir():
        return f"discovery file {path} is a directory, not the file a serving job writes"
    if not path.is_file():
        return f"discovery file {path} does not exist (is the serving job running?)"
    return None


def read_discovery_file(path: Path) -> str:
    """A serving job's discovery file: a URL on one line, or JSON with a 'url' (or 'host' + 'port') field."""
    problem = discovery_file_problem(path)
    if problem:
        raise UserError(problem)
    try:
        text = path.read_bytes()[:65536].decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        raise UserError(f"discovery file {path} is not readable text") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        data = text
    if isinstance(data, dict):
        host_port = f"http://{data['host']}:{data['port']}" if "host" in data and "port" in data else None
        url = data.get("url") or host_port
    else:
        url = data
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise UserError(f"discovery file {path} holds no http(s) URL")
    return check_url(url.rstrip("/"), f"discovery file {path}")


def check_url(url: str, where: str = "endpoint URL") -> str:
    """An http(s) URL with a host and a valid port, or one line naming what is wrong."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UserError(f"{where}: {url[:100]!r} is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise UserError(f"{where}: {url[:100]!r} must start with http:// or https://")
    if not parts.hostname:
        raise UserError(f"{where}: {url[:100]!r} has no host")
    del port
    return url


MAX_RESPONSE_BYTES = 1 << 20  # a chat completion of a few thousand tokens is a few tens of KB


class _Deadline(Exception):
    pass


@contextlib.contextmanager
def _alarm(seconds: float):
    """Raise _Deadline after ``seconds`` wherever the request is (connect, headers, body), with SIGALRM in the main
    thread; elsewhere only the socket timeouts and the read loop's check bound it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise _Deadline()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _request(url: str, payload: dict | None, timeout: float, deadline: float | None = None) -> dict:
    """One JSON request with a per-request timeout, a total deadline that holds even against a server that
    drips a byte every few seconds (the socket timeout alone would not), and a cap on the reply's size."""
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="POST" if data else "GET")
    end = time.monotonic() + timeout
    if deadline is not None:
        end = min(end, deadline)
    if end <= time.monotonic():
        raise _Deadline()
    with _alarm(end - time.monotonic()):  # bounds the headers and an error body too, not only our read loop
        with urllib.request.urlopen(req, timeout=max(0.1, min(timeout, end - time.monotonic()))) as resp:
            body = bytearray()
            while True:
                if time.monotonic() > end:
                    raise _Deadline()
                chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
                if not chunk:
                    break
                body += chunk
                if len(body) > MAX_RESPONSE_BYTES:
                    raise UserError(f"endpoint {url} sent more than {MAX_RESPONSE_BYTES} bytes; refusing the reply")
    try:
        out = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: bad JSON, or an int past 4300 digits
        raise UserError(f"endpoint {url} did not answer JSON (got {bytes(body[:60])!r}...): is it an "
                        "OpenAI-compatible server?") from None
    if not isinstance(out, dict):
        raise UserError(f"endpoint {url} answered {type(out).__name__}, not a JSON object")
    return out


def endpoint_generate(base_url: str, model: str | None, prompts: list[str], max_tokens: int, reasoning: bool,
                      timeout: float = 120.0, deadline: float | None = None) -> list[Generation]:
    """``timeout``: seconds per request; ``deadline``: seconds for the whole run (default: timeout per prompt)."""
    base = check_url(base_url.rstrip("/"))
    root = base[:-3] if base.endswith("/v1") else base
    end = time.monotonic() + (deadline if deadline is not None else timeout * max(1, len(prompts)))
    try:
        models = _request(f"{root}/v1/models", None, timeout=min(10.0, timeout), deadline=end)
    except (_Deadline, TimeoutError):
        raise UserError(f"endpoint {root} did not answer /v1/models within {min(10.0, timeout):g} s") from None
    except (urllib.error.URLError, ConnectionError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"endpoint {root} is unreachable ({reason}); check --endpoint-url / --discovery-file") from None
    data = models.get("data")
    served = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
    if model is None or (served and model not in served and not Path(model).exists()):
        model = model if model in served else (served[0] if served else model)
    out: list[Generation] = []
    for prompt in prompts:
        payload: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                                   "max_tokens": max_tokens, "temperature": 0.0, "stream": False}
        if reasoning is not None:
            payload["chat_template_kwargs"] = {"enable_thinking": reasoning}
        try:
            resp = _request(f"{root}/v1/chat/completions", payload, timeout, deadline=end)
        except urllib.error.HTTPError as exc:
            try:
                with _alarm(2.0):
                    detail = exc.read(200)
            except (_Deadline, OSError, http.client.HTTPException):
                detail = b""
            raise UserError(f"endpoint {root} answered HTTP {exc.code}: {detail!r}") from None
        except (_Deadline, TimeoutError):
            raise UserError(f"endpoint {root} did not answer prompt {len(out) + 1} of {len(prompts)} in time "
                            f"(--timeout {timeout:g} s per request, {end - time.monotonic() + 0:.0f} s of the "
                            "deadline left); is the server overloaded?") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise UserError(f"endpoint {root} failed mid-run: {getattr(exc, 'reason', exc)}") from None
        try:
            choice = resp["choices"][0]
            text = (choice.get("message") or {}).get("content") or ""
            if not isinstance(text, str):
                raise TypeError("content is not a string")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate (\ud800): no report could be written with it
                raise UserError(f"endpoint {root} answered text that is not valid Unicode (a lone surrogate in "
                                f"the reply to prompt {len(out) + 1}); is the server's detokenizer broken?") from None
            n = (resp.get("usage") or {}).get("completion_tokens")
            n_prompt = (resp.get("usage") or {}).get("prompt_tokens")
            if isinstance(n_prompt, bool) or not isinstance(n_prompt, int) or not 0 <= n_prompt <= 100_000_000:
                n_prompt = None
            if n is None:
                n = len(text.split())
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 10_000_000:
                raise ValueError(f"usage.completion_tokens={str(n)[:20]} is not a token count")
            out.append((text.strip(), n, choice.get("finish_reason") == "stop", n_prompt, None))
        except (KeyError, IndexError, TypeError, AttributeError, ValueError, OverflowError) as exc:
            raise UserError(f"endpoint {root} answered a chat completion without choices[0].message.content "
                            f"({type(exc).__name__}: {str(exc)[:80]})") from None
    return out
