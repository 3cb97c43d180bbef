"""Generation backends. Each returns, per prompt, (text, generated token count, finished-by-itself).

  hf        transformers: a local HF directory or a hub id; greedy decoding with the model's chat template
  endpoint  an already running OpenAI-compatible server (plain HTTP from the standard library)
  megatron  a Megatron checkpoint directly, on GPUs (pipeline/bridge.py; one rank per GPU under torchrun)
"""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.common.errors import UserError

log = logging.getLogger(__name__)
Generation = tuple[str, int, bool]


def hf_generate(model_path: str, prompts: list[str], max_tokens: int, reasoning: bool) -> list[Generation]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(model_path)
    if not p.exists() and ("/" not in model_path or model_path.startswith((".", "/"))):
        raise UserError(f"model {model_path} does not exist (a local HF directory or a hub id ORG/NAME)")
    try:
        tok = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    except OSError as exc:
        raise UserError(f"cannot load model {model_path}: {str(exc).splitlines()[0][:200]}") from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).eval()
    eos = {tok.eos_token_id} | set(model.generation_config.eos_token_id
                                   if isinstance(model.generation_config.eos_token_id, list)
                                   else [model.generation_config.eos_token_id])
    eos.discard(None)
    out = []
    for prompt in prompts:
        msgs = [{"role": "user", "content": prompt}]
        kwargs = {"enable_thinking": reasoning} if tok.chat_template and "enable_thinking" in tok.chat_template else {}
        enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True, **kwargs)
        enc = {k: v.to(device) for k, v in enc.items()}
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        new = gen[0, enc["input_ids"].shape[1]:].tolist()
        finished = bool(new) and new[-1] in eos
        text = tok.decode(new, skip_special_tokens=True).strip()
        out.append((text, len(new), finished))
    return out


def read_discovery_file(path: Path) -> str:
    """A serving job's discovery file: a URL on one line, or JSON with a 'url' (or 'host' + 'port') field."""
    if not path.is_file():
        raise UserError(f"discovery file {path} does not exist (is the serving job running?)")
    text = path.read_text().strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = text
    if isinstance(data, dict):
        url = data.get("url") or (f"http://{data['host']}:{data['port']}" if "host" in data and "port" in data else None)
    else:
        url = str(data)
    if not url or not url.startswith(("http://", "https://")):
        raise UserError(f"discovery file {path} holds no http(s) URL")
    return url.rstrip("/")


def _request(url: str, payload: dict | None, timeout: float) -> dict:
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="POST" if data else "GET")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def endpoint_generate(base_url: str, model: str | None, prompts: list[str], max_tokens: int, reasoning: bool,
                      timeout: float = 300.0) -> list[Generation]:
    base = base_url.rstrip("/")
    root = base[:-3] if base.endswith("/v1") else base
    try:
        models = _request(f"{root}/v1/models", None, timeout=10)
    except (urllib.error.URLError, socket.timeout, ConnectionError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"endpoint {root} is unreachable ({reason}); check --endpoint-url / --discovery-file") from None
    served = [m.get("id") for m in models.get("data", [])]
    if model is None or (served and model not in served and not Path(model).exists()):
        model = model if model in served else (served[0] if served else model)
    out = []
    for prompt in prompts:
        payload = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                   "temperature": 0.0, "stream": False}
        if reasoning is not None:
            payload["chat_template_kwargs"] = {"enable_thinking": reasoning}
        try:
            resp = _request(f"{root}/v1/chat/completions", payload, timeout)
        except urllib.error.HTTPError as exc:
            raise UserError(f"endpoint {root} answered HTTP {exc.code}: {exc.read()[:200]!r}") from None
        except (urllib.error.URLError, socket.timeout, OSError) as exc:
            raise UserError(f"endpoint {root} failed mid-run: {getattr(exc, 'reason', exc)}") from None
        choice = resp["choices"][0]
        text = (choice.get("message") or {}).get("content") or ""
        n = (resp.get("usage") or {}).get("completion_tokens") or len(text.split())
        out.append((text.strip(), int(n), choice.get("finish_reason") == "stop"))
    return out
