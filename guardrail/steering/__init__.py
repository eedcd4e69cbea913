"""Activation steering: the math (``math``), the vector file format (``vector``) and the
request-level spec and report (``spec``). Building vectors is offline work:
``guardrail.offline.steering_build`` (``guardrail steer build``).

Example:
    >>> from guardrail.steering import Steering
    >>> Steering(vector="SmolLM2-135M-Instruct").vector
    'SmolLM2-135M-Instruct'
"""

from guardrail.steering.math import (
    SteeringMethod,
    add_vector,
    adjust_rs,
    direction_from_pairs,
    steering_delta,
)
from guardrail.steering.spec import Steering, SteeringLike, SteeringReport
from guardrail.steering.vector import (
    STEERING_SUFFIX,
    SteeringBuildInfo,
    SteeringMetadata,
    SteeringVector,
    load_steering_vector,
    packaged_steering_vectors,
)

__all__ = [
    "STEERING_SUFFIX",
    "Steering",
    "SteeringBuildInfo",
    "SteeringLike",
    "SteeringMetadata",
    "SteeringMethod",
    "SteeringReport",
    "SteeringVector",
    "add_vector",
    "adjust_rs",
    "direction_from_pairs",
    "load_steering_vector",
    "packaged_steering_vectors",
    "steering_delta",
]
