"""Environment pipeline: runtimes, base-model assets, validation checks."""
