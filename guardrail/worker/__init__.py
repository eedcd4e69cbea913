"""The worker side: vLLM's worker extension, the probe, steering hooks and the stop processor.

This package is the only code that touches vLLM internals; it is imported by vLLM inside the
worker process (``guardrail.protocol.WORKER_EXTENSION``), never by the caller side.
"""
