"""YAML as the suite reads it: PyYAML's safe loader, with numbers as YAML 1.2 (and OmegaConf, and Hydra's override
grammar) read them. YAML 1.1 - PyYAML's - reads ``1e-3`` as the *string* "1e-3" (a float needs a dot: ``1.0e-3``), so
``lr: 1e-3`` in a config and ``optimizer.lr=1e-3`` on the command line meant different things, and an experiment axis
``[1e-3, 0.001]`` made two runs of one value."""

from __future__ import annotations

import re
from typing import Any

import yaml


class Loader(yaml.SafeLoader):
    """SafeLoader + the float forms YAML 1.2 adds (``1e-3``, ``2E5``), as OmegaConf's loader resolves them."""


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                 |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                 |\.[0-9_]+(?:[eE][-+][0-9]+)?
                 |[-+]?\.(?:inf|Inf|INF)
                 |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def load(text: str) -> Any:
    """``yaml.safe_load`` with YAML 1.2 numbers (raises ``yaml.YAMLError`` as it does)."""
    return yaml.load(text, Loader=Loader)  # a SafeLoader subclass: no arbitrary objects
