"""Data only: the labelled calibration pool (JSONL files and manifest.json) that installs with
the package. Read it with :func:`guardrail.offline.pool.load_pool`; rebuilt by
``benchmarks/make_pool.py``."""
