"""Offline work on labelled data: datasets, calibration, evaluation and building steering
vectors. Used by the ``guardrail`` CLI; never on the serving path."""
