"""The GPU ready check reads the export's verification record from its output (tests/gpu/device_check.sh): on the
first H200 run (2026-12-04) Megatron printed a Python dict on one line before the record and the check read that."""

from __future__ import annotations

from pipeline.env.device_check import verdict_record

H200_EXPORT_OUTPUT = """Broadcasting config from rank 0 to all 1 ranks
Loading checkpoint directly from iteration directory /tmp/dc/tiny-llama-megatron/iter_0000000
sharded_state_dict metadata loaded from the checkpoint: {'singleton_local_shards': False, 'chained_optim_avoid_prefix': True}
Success: All tensors from the original checkpoint were written.
{
  "verdict": "PASS",
  "max_abs_logit_diff": 0.5171438157558441,
  "kl": 0.0021688129162586397,
  "top1_agreement": 0.9333333333333333,
  "reference_loss": 7.731329917907715,
  "uniform_loss": 5.950642552587727
}
exported: /tmp/dc/tiny-llama-megatron/iter_0000000/hf
"""


def test_the_record_is_the_json_object_not_megatrons_dict_line():
    rec = verdict_record(H200_EXPORT_OUTPUT)
    assert rec["verdict"] == "PASS" and rec["top1_agreement"] == 0.9333333333333333


def test_no_record_is_an_empty_dict():
    assert verdict_record("x {'a': 1}\n{\nnot json\n}\n") == {}
    assert verdict_record('{\n  "other": 1\n}\n') == {}
    assert verdict_record("") == {}
