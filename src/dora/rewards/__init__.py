"""Verifiers (exact match, countdown, math) and the concurrent reward service.

Stable API::

    make_verifier(name, **config) -> Verifier     # "exact_match", "countdown", "math"
    verifier.verify(completion, prompt) -> VerifierResult(reward, correct, details)
    RewardService(task_verifiers=..., timeout_s=..., overlong=...)
        await service.score(trajectory) -> ScoredTrajectory   # never raises, never drops
"""

from dora.rewards.base import (
    Verifier,
    VerifierConfig,
    VerifierError,
    VerifierResult,
    last_answer_line,
    make_verifier,
    register_verifier,
    verifier_names,
)
from dora.rewards.countdown import CountdownVerifier, CountdownVerifierConfig, ExpressionError
from dora.rewards.exact import ExactMatchConfig, ExactMatchVerifier
from dora.rewards.math import MathVerifier, MathVerifierConfig
from dora.rewards.shaping import OverlongShaping

register_verifier("exact_match", ExactMatchConfig, ExactMatchVerifier)
register_verifier("countdown", CountdownVerifierConfig, CountdownVerifier)
register_verifier("math", MathVerifierConfig, MathVerifier)

from dora.rewards.service import DEFAULT_TASK_VERIFIERS, RewardService  # noqa: E402

__all__ = [
    "DEFAULT_TASK_VERIFIERS",
    "CountdownVerifier",
    "CountdownVerifierConfig",
    "ExactMatchConfig",
    "ExactMatchVerifier",
    "ExpressionError",
    "MathVerifier",
    "MathVerifierConfig",
    "OverlongShaping",
    "RewardService",
    "Verifier",
    "VerifierConfig",
    "VerifierError",
    "VerifierResult",
    "last_answer_line",
    "make_verifier",
    "register_verifier",
    "verifier_names",
]
