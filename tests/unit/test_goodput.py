"""The goodput split (training/goodput.py) on event streams of known shape, and its writers."""

import json
import time

import pytest

from pipeline.slurm.allocation import _slurm_time
from pipeline.training import goodput
from pipeline.training.records import ProgressLog, finish_completed, finish_preempted

PARTS = ("queue_seconds", "startup_seconds", "step_seconds", "checkpoint_seconds", "redone_seconds",
         "restart_seconds", "other_seconds")


def job(t, submit, eligible, start, jid="7", restart=0):
    return {"event": "job", "t": t, "job": jid, "restart": restart, "submit": submit, "eligible": eligible,
            "start": start}


def attempt(t, steps, *, ready, first_step=1, step_s=2.0, save_at=(), save_s=1.0, end=None):
    """An attempt starting at ``t``, ready at ``ready``, ``steps`` steps of ``step_s`` each, a save after each step in
    ``save_at``; returns (events, time of its last event)."""
    ev = [{"event": "attempt", "t": t, "pid": 1}, {"event": "ready", "t": ready}]
    now = ready
    for s in range(first_step, first_step + steps):
        now += step_s
        ev.append({"event": "step", "t": now, "step": s, "seconds": step_s})
        if s in save_at:
            now += save_s
            ev.append({"event": "save", "t": now, "step": s, "seconds": save_s})
    if end:
        ev.append({"event": "end", "t": now, "status": end, "step": first_step + steps - 1})
    return ev, now


def total_of_parts(g):
    return sum(g[k] for k in PARTS)


def test_one_uninterrupted_attempt():
    a, last = attempt(112.0, 10, ready=120.0, save_at=(10,), end="completed")
    g = goodput.split([job(110.5, 100.0, 100.0, 110.0), *a])
    assert g["queue_seconds"] == 10.0 and g["startup_seconds"] == 10.0
    assert g["step_seconds"] == 20.0 and g["checkpoint_seconds"] == 1.0
    assert g["redone_seconds"] == g["restart_seconds"] == g["other_seconds"] == 0.0
    assert g["total_seconds"] == last - 100.0 == total_of_parts(g)
    assert g["allocated_seconds"] == last - 110.0 and g["goodput"] == round(20.0 / 21.0 * 21.0 / 31.0, 4)
    assert (g["attempts"], g["requeues"], g["kept_steps"], g["redone_steps"]) == (1, 0, 10, 0)


def test_in_job_restart_redoes_the_steps_after_the_checkpoint():
    # 12 steps, checkpoint at 10, killed after step 12; the restart resumes at 11 and finishes 20
    a1, last1 = attempt(101.0, 12, ready=105.0, save_at=(10,))
    a2, last2 = attempt(last1 + 3.0, 10, ready=last1 + 9.0, first_step=11, save_at=(20,), end="completed")
    g = goodput.split([job(100.5, 100.0, 100.0, 100.0), *a1, *a2])
    assert g["redone_steps"] == 2 and g["redone_seconds"] == 4.0  # steps 11 and 12 of the first attempt
    assert g["kept_steps"] == 20 and g["step_seconds"] == 40.0
    assert g["restart_seconds"] == 9.0  # the first attempt's last record to the second one's first step
    assert g["checkpoint_seconds"] == 2.0 and g["startup_seconds"] == 5.0
    assert g["total_seconds"] == last2 - 100.0 == pytest.approx(total_of_parts(g))
    assert g["attempts"] == 2 and g["requeues"] == 0 and abs(g["other_seconds"]) < 1e-6


def test_requeue_splits_the_gap_into_hold_queue_and_start_up():
    a1, last1 = attempt(102.0, 8, ready=106.0, save_at=(8,), end="preempted")
    # requeued 2 s after the save, held 11 s (Slurm's requeue hold), queued 5 s, started, ready 7 s later
    sub2 = last1 + 2.0
    a2, last2 = attempt(sub2 + 17.0, 4, ready=sub2 + 23.0, first_step=9, save_at=(12,), end="completed")
    g = goodput.split([job(101.0, 100.0, 100.0, 101.0), *a1,
                       job(sub2 + 16.5, sub2, sub2 + 11.0, sub2 + 16.0, restart=1), *a2])
    assert g["queue_seconds"] == 1.0 + 5.0
    assert g["restart_seconds"] == 2.0 + 11.0 + 7.0  # to the requeue, the hold, the second start-up
    assert g["redone_steps"] == 0 and g["kept_steps"] == 12
    assert g["allocated_seconds"] == pytest.approx((last1 - 101.0) + (last2 - sub2 - 16.0))
    assert g["total_seconds"] == pytest.approx(total_of_parts(g)) and g["requeues"] == 1 and g["jobs"] == ["7"]


def test_a_chain_successor_submitted_early_queues_only_after_its_predecessor():
    a1, last1 = attempt(101.0, 4, ready=103.0, end="preempted")
    # the successor was submitted at the start (t=101) and eligible once the first job ended (last1 + 1)
    a2, last2 = attempt(last1 + 4.0, 4, ready=last1 + 6.0, first_step=5, end="completed")
    g = goodput.split([job(101.0, 100.0, 100.0, 101.0, jid="1"), *a1,
                       job(last1 + 3.5, 101.0, last1 + 1.0, last1 + 3.0, jid="2"), *a2])
    assert g["queue_seconds"] == 1.0 + 2.0 and g["restart_seconds"] == 1.0 + 3.0
    assert g["jobs"] == ["1", "2"] and g["total_seconds"] == pytest.approx(total_of_parts(g))


def test_launches_after_completion_and_cut_lines_are_left_out():
    a, last = attempt(101.0, 3, ready=102.0, end="completed")
    later = job(last + 500.0, last + 400.0, last + 400.0, last + 499.0)  # a resubmission that found it finished
    g = goodput.split([job(100.0, 100.0, 100.0, 100.0), *a, later])
    assert g["total_seconds"] == last - 100.0 and g["attempts"] == 1
    assert goodput.split([]) is None
    assert goodput.split([job(100.0, 100.0, 100.0, 100.0)]) is None  # launched, no rank yet


def test_clock_events_and_the_summary(tmp_path, monkeypatch):
    monkeypatch.delenv("PIPELINE_SAVE_REQUEST_FILE", raising=False)
    goodput.record_job(tmp_path, None, 0)
    progress = ProgressLog(tmp_path, tokens_per_step=10)
    progress.clock.attempt()
    for s in (1, 2, 3):
        progress.clock.ready()
        time.sleep(0.05)
        progress.log(s, {"loss": 3.0 - s})
        progress.clock.step(s)
    progress.clock.save_begin()
    time.sleep(0.05)
    progress.clock.save_end(3)
    finish_preempted(tmp_path, progress, 3, 6, 1.0)
    kinds = [json.loads(x)["event"] for x in (tmp_path / goodput.EVENTS).read_text().splitlines()]
    assert kinds == ["job", "attempt", "ready", "step", "step", "step", "save", "end"]
    g = json.loads((tmp_path / "metrics_summary.json").read_text())["goodput"]
    assert g["kept_steps"] == 3 and g["step_seconds"] >= 0.15 and g["checkpoint_seconds"] >= 0.05
    assert abs(g["other_seconds"]) < 0.05 and g["total_seconds"] == pytest.approx(total_of_parts(g), abs=0.06)
    summary = finish_completed(tmp_path, None, progress, 3, 1.0)
    assert summary["goodput"]["attempts"] == 1
    other = ProgressLog(tmp_path, tokens_per_step=10, writer=False)  # another rank: writes nothing
    other.clock.attempt()
    other.clock.step(4)
    assert len((tmp_path / goodput.EVENTS).read_text().splitlines()) == len(kinds) + 1  # + the completed end


def test_slurm_times_are_parsed_or_refused():
    assert _slurm_time("2026-12-01T16:57:06") == time.mktime((2026, 12, 1, 16, 57, 6, 0, 0, -1))
    for bad in ("Unknown", "N/A", "", None, "yesterday"):
        assert _slurm_time(bad) is None
