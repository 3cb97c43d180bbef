"""Would pydantic v2 type the training config as the suite's checker does? A measurement behind decision 85.

    .venv/bin/python bench/probe_pydantic_config.py

Builds pydantic's ``TypeAdapter`` over the suite's own config dataclasses (``pipeline.config.schema.TrainingConfig``,
unchanged) and gives it the values a user writes wrongly, next to what ``load_config`` (the suite's checker) says
of the same override. Prints a Markdown table, then the import and build times, and whether a strict, extra-forbid
configuration can be set on these dataclasses without redeclaring them. Nothing is timed in a test; this is a probe.
"""

from __future__ import annotations

import time

CASES = [  # (override as the user writes it, the value YAML / the override grammar gives pydantic)
    ("train.train_iters=abc", "abc"),
    ("optimizer.lr=fast", "fast"),
    ("model.sequence_parallel=yes", "yes"),
    ("logger.wandb_project=7", 7),
    ("model.recompute_granularity=fulll", "fulll"),
    ("train.micro_batch_size=99999999999999999999", 99999999999999999999),
    ("train.global_batch_size='8'", "8"),
    ("model.tensor_model_parallel_size=2.0", 2.0),
    ("+optimizer.lrr=1", 1),
]


def main() -> int:
    t0 = time.perf_counter()
    import pydantic

    imported = time.perf_counter() - t0
    from pipeline.common.errors import UserError
    from pipeline.config.loader import load_config
    from pipeline.config.schema import TrainingConfig

    t0 = time.perf_counter()
    adapter = pydantic.TypeAdapter(TrainingConfig)
    built = time.perf_counter() - t0
    print("| override | the suite's checker | pydantic (lax, the default for dataclasses) |")
    print("|---|---|---|")
    for override, value in CASES:
        key = override.lstrip("+").split("=")[0]
        section, name = key.split(".")
        try:
            cfg = load_config(None, [override], {"train": {"train_iters": 1, "micro_batch_size": 1}})
            ours = "; ".join(cfg.problems) or ("kept for Bridge (cfg.extra)" if cfg.extra else "accepted")
        except UserError as exc:
            ours = str(exc).splitlines()[0]
        try:
            out = adapter.validate_python({section: {name: value}})
            theirs = f"accepted as {getattr(getattr(out, section), name, '(dropped)')!r}"
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            theirs = f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
        print(f"| `{override}` | {ours} | {theirs} |")
    try:
        pydantic.TypeAdapter(TrainingConfig, config=pydantic.ConfigDict(strict=True, extra="forbid"))
        strict = "yes"
    except pydantic.PydanticUserError as exc:
        strict = "no: " + str(exc).splitlines()[0]
    print(f"\npydantic {pydantic.VERSION}: import {imported:.3f} s, TypeAdapter(TrainingConfig) built in {built:.3f} s")
    print(f"strict + extra='forbid' on the stdlib dataclasses without redeclaring them: {strict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
