"""The data of the pipeline_smoke task: the JSONL beside this file (the harness calls ``load`` through the YAML's
``custom_dataset``; a path relative to the YAML, whatever the working directory)."""

import json
from pathlib import Path

DATA = Path(__file__).with_name("pipeline_smoke.jsonl")


def load(**_metadata):
    import datasets

    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
