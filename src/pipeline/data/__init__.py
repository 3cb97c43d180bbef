"""Data pipeline: sources, chat templates + loss masks, tokenization, packing, Parquet and indexed writers."""
