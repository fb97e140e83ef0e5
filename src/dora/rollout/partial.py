"""Partial-rollout baseline (AReaL / slime style): what a generator does at a weight update.

At every update each engine stops, interrupts its in-flight requests, loads the new weights
and *resumes the interrupted requests first* under the new version, re-prefilling prompt +
tokens so far. AReaL's client re-sends an aborted request to its server as soon as generation
continues, ahead of new work; slime puts aborted samples at the head of the next rollout.
Resuming them anywhere else (e.g. at the back of the shared queue) makes the long tail wait
behind fresh requests and is not the baseline the literature measures.

So the generator keeps an interrupted request on its engine, with its queue lease (the
original message stays unacked and heartbeated: a crash redelivers it), and re-adds it right
after the load with ``RESUME_PRIORITY``. Requests still *queued* under an older version when the
update came are served before the new version's queue (``backlog``), rewritten to the new
version: in partial rollout every engine serves the newest weights only.
"""

from __future__ import annotations

from dora.engines.base import PartialOutput
from dora.events import ResumeState, RolloutRequest

RESUME_PRIORITY = 1
"""Above the default 0: an engine admits resumed and older-backlog requests before new ones."""


def resumed(part: PartialOutput, loaded: int | None, version: int) -> RolloutRequest:
    """The request ``part`` was aborted from, to continue under ``version``.

    ``loaded`` is the version that produced the tokens generated since the last resume (the
    engine's weights at the abort); per-token versions and the re-prefill count travel in
    ``ResumeState`` (the engine adds the tokens it re-prefills on admission).
    """
    old = part.request
    prior = old.resume or ResumeState()
    producer = loaded if loaded is not None else old.version
    new_tokens = len(part.token_ids) - len(prior.token_ids)
    resume = ResumeState(
        token_ids=part.token_ids,
        logprobs=part.logprobs,
        token_versions=(*prior.token_versions, *([producer] * new_tokens)),
        reprefilled_tokens=prior.reprefilled_tokens,
        engines=part.engines,
    )
    return retag(old, version).model_copy(update={"resume": resume})


def retag(request: RolloutRequest, version: int) -> RolloutRequest:
    """``request`` served by ``version``'s weights, ahead of new work (same id: one
    trajectory per request, whatever happens). Its admitted tag stays: the dispatcher's ledger
    and the learner count the group under the version it was admitted with."""
    return request.model_copy(
        update={
            "event_id": f"{request.request_id}-v{version}",
            "version": version,
            "admitted_version": request.dispatch_version,
            "priority": max(request.priority, RESUME_PRIORITY),
        }
    )
