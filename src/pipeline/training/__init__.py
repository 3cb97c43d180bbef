"""Training pipeline: preflight, launch, engines (local, Megatron Bridge), fault tolerance, run records."""
