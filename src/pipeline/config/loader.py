"""Load a training config with one precedence: recipe defaults < YAML < command-line Hydra overrides.

The override grammar is hydra-core's own (``key=value``, ``+key=value``, ``++key=value``, ``~key``,
lists ``[1,2]``, quoted strings). Unknown keys fail with a hint naming the closest valid key.
"""

from __future__ import annotations

import getpass
import os
from pathlib import Path
from typing import Any

import yaml

from pipeline.common import yamlio
from pipeline.common.errors import UserError, did_you_mean
from pipeline.common.mappings import drop_unset
from pipeline.config.schema import TrainingConfig, schema_dict


def _flat_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.append(key)
        if isinstance(v, dict):
            out.extend(_flat_keys(v, key + "."))
    return out


def _hint(key: str, known: list[str]) -> str:
    hint = did_you_mean(key, known)
    if hint:
        return hint
    section = key.split(".")[0]
    same = [k for k in known if k.startswith(section + ".") and k.count(".") == key.count(".")]
    return f" (valid keys in '{section}': {', '.join(s.split('.')[-1] for s in same[:12])})" if same else ""


def _merge_known(base: dict, update: dict, where: str, known: list[str], path: str = "") -> None:
    """Merge ``update`` into ``base``; every key must already exist in ``base`` (the schema)."""
    for k, v in update.items():
        key = f"{path}{k}"
        if k not in base:
            raise UserError(f"{where}: unknown key '{key}'{_hint(key, known)}; use +{key}=... on the command line "
                            "to pass a key through to Megatron Bridge")
        if isinstance(base[k], dict) and isinstance(v, dict) and k != "env_vars":
            _merge_known(base[k], v, where, known, key + ".")
        elif isinstance(base[k], dict) and v is not None and not isinstance(v, dict) and base[k]:
            raise UserError(f"{where}: '{key}' is a section, not a value")
        else:
            base[k] = v


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise UserError(f"config file {path} is a directory; pass a YAML file (e.g. configs/local/tiny_moe_sft.yaml)")
    if not path.is_file():
        raise UserError(f"config file {path} is not a regular file (a FIFO, device or socket)" if path.exists() else
                        f"config file {path} does not exist")
    try:
        data = yamlio.load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: invalid YAML: {str(exc).splitlines()[0]}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file (invalid UTF-8); expected a YAML config") from None
    except ValueError as exc:  # e.g. an integer past Python's 4300-digit conversion limit
        raise UserError(f"{path}: a value cannot be read: {str(exc)[:120]}") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: the top level must be a mapping of sections (train, model, dataset, ...)")
    return data


def parse_overrides(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed = []
    for o in overrides:
        try:
            ovs = parser.parse_overrides([o])
        except HydraException as exc:
            msg = " ".join(str(exc).split())
            raise UserError(f"malformed override '{o[:80]}': {msg[:200]}") from None
        except ValueError as exc:  # e.g. an integer past Python's 4300-digit conversion limit
            raise UserError(f"malformed override '{o[:80]}': {str(exc)[:120]}") from None
        for ov in ovs:
            if ov.is_sweep_override():
                raise UserError(f"override '{o}' is a sweep (a,b / choice() / range() / glob()): a launch is one run; "
                                "submit one run per value (quote a literal comma: key='a,b'; a list is key=[a,b])")
        parsed.extend(ovs)
    return parsed


def apply_overrides(cfg: dict, overrides: list[str]) -> dict:
    from hydra.core.override_parser.types import OverrideType

    known = _flat_keys(cfg)
    for ov in parse_overrides(overrides):
        key = ov.key_or_group
        if ov.package:
            raise UserError(f"override '{ov.input_line}': package syntax (@) is not supported here")
        parts = key.split(".")
        node = cfg
        for p in parts[:-1]:
            if p not in node or not isinstance(node[p], dict):
                if ov.type in (OverrideType.ADD, OverrideType.FORCE_ADD) and p not in node:
                    node[p] = {}
                elif p in node and node[p] is None and ov.type in (OverrideType.ADD, OverrideType.FORCE_ADD):
                    node[p] = {}
                else:
                    raise UserError(f"override '{ov.input_line}': unknown key '{key}'{_hint(key, known)}")
            node = node[p]
        leaf = parts[-1]
        if ov.type == OverrideType.DEL:
            if leaf not in node:
                raise UserError(f"override '{ov.input_line}': cannot delete '{key}', it is not set")
            del node[leaf]
            continue
        value = ov.value()
        value = _to_plain(value)
        if ov.type == OverrideType.CHANGE:
            if leaf not in node:
                raise UserError(f"override '{ov.input_line}': unknown key '{key}'{_hint(key, known)}; "
                                f"use +{key}=... to add a key the schema does not know")
            if isinstance(node[leaf], dict) and node[leaf] and not isinstance(value, dict):
                raise UserError(f"override '{ov.input_line}': '{key}' is a section, not a value")
        elif ov.type == OverrideType.ADD and leaf in node and node[leaf] is not None:
            raise UserError(f"override '{ov.input_line}': '{key}' already exists; use {key}=... to change it")
        if isinstance(node.get(leaf), dict) and isinstance(value, dict) and value:
            # section={k: v, ...} merges into the section, as Hydra merges a dict into a config node (it does not
            # clear the section's other values)
            if leaf == "env_vars":
                node[leaf] = {**node[leaf], **value}
            else:
                _merge_known(node[leaf], value, f"override '{ov.input_line}'", known, key + ".")
            continue
        node[leaf] = value
    return cfg


def _to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


def load_config(path: str | Path | None, overrides: list[str] | None = None,
                recipe_defaults: dict | None = None) -> TrainingConfig:
    """The resolved, typed config: schema < recipe defaults < YAML < overrides. Raises UserError on a bad file, an
    unknown key or a malformed override; a value of the wrong type is listed in ``problems`` (the preflight
    reports it with the rest)."""
    return TrainingConfig.from_dict(resolve_dict(path, overrides, recipe_defaults))


def resolve_dict(path: str | Path | None, overrides: list[str] | None = None,
                 recipe_defaults: dict | None = None) -> dict:
    """The merged config as a plain dict (interpolations resolved), before typing."""
    cfg = schema_dict()
    known = _flat_keys(cfg)
    if recipe_defaults:
        _merge_known(cfg, recipe_defaults, "recipe defaults", known)
    if path is not None:
        _merge_known(cfg, read_yaml(path), str(path), known)
    cfg = apply_overrides(cfg, list(overrides or []))
    yamlio.refuse_missing(cfg, "the config")
    return resolve_interpolations(cfg)



def resolve_interpolations(cfg: dict) -> dict:
    """Resolve OmegaConf interpolations (``${oc.env:VAR,default}``, ``${model.seq_length}``). ``${oc.env:USER}`` (a
    shipped config's per-user save folder) resolves where a batch or CI environment sets no USER: the process's
    login name, as the shell launchers export it (common/lib.sh)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not os.environ.get("USER"):
        os.environ["USER"] = getpass.getuser()
    try:
        return OmegaConf.to_container(OmegaConf.create(cfg), resolve=True)
    except OmegaConfBaseException as exc:
        raise UserError(f"cannot resolve the config: {' '.join(str(exc).split())[:300]}") from None


def strip_suite_only(cfg: TrainingConfig) -> dict:
    """The config for Megatron Bridge: no suite-only keys and no unset (None) values or empty sections."""
    out = cfg.to_dict()
    out.pop("pipeline", None)
    out["dataset"].pop("dataset_name", None)
    return drop_unset(out)
