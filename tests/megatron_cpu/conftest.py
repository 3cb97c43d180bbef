from tests.integration.conftest import slurm  # noqa: F401  (the local Slurm, for the 2-node case)
