"""Jobs: what every planned job of the suite is (``jobs/plan.py``'s ``BasePlan``), whatever it runs. Just above
``pipeline.config``: training's and the checkpoint side's plans extend it, and it imports nothing above config."""
