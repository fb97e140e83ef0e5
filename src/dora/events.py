"""Every wire type of dora, and nothing else.

Events are strict (unknown fields are rejected), frozen (a received event is a fact, not a
mutable object) and carry ``schema_version`` so a consumer can refuse what it cannot read.
Their JSON Schema is exported to ``schemas/`` so services in any language can join a stream.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1
"""Bump when a wire type changes incompatibly; consumers reject other versions."""


def new_id() -> str:
    """A fresh, globally unique event id (used for dedupe on the bus)."""
    return uuid.uuid4().hex


def now() -> float:
    """Wall-clock seconds since the epoch, the unit of every timestamp on the wire."""
    return time.time()


class Model(BaseModel):
    """Strict, frozen base of every wire type and of their nested parts."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Event(Model):
    """A message that travels on its own on a subject."""

    kind: ClassVar[str] = "event"
    event_id: str = Field(default_factory=new_id, min_length=1, max_length=128)
    schema_version: Literal[1] = Field(
        default=SCHEMA_VERSION, description="Wire format version; other values are rejected."
    )
    created_at: float = Field(default_factory=now, description="Seconds since the epoch.")


# --------------------------------------------------------------------------- prompts


class Prompt(Event):
    """A task instance with a verifiable answer, produced by a prompt source."""

    kind: ClassVar[str] = "prompt"
    prompt_id: str = Field(min_length=1, max_length=256, description="Stable id of the task.")
    text: str = Field(max_length=1_000_000, description="Prompt text given to the model.")
    answer: str = Field(default="", max_length=100_000, description="Ground-truth answer.")
    task: str = Field(default="", max_length=128, description="Task family, e.g. arithmetic.")
    split: Literal["train", "dev", "eval"] = "train"
    metadata: dict[str, str | int | float | bool] = Field(default_factory=dict)


class SamplingParams(Model):
    """How to sample one completion; deterministic given ``seed``."""

    temperature: float = Field(default=1.0, ge=0.0, le=100.0, description="0 means greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k.")
    seed: int = Field(default=0, ge=0, lt=2**63)
    max_tokens: int = Field(default=256, description="Upper bound on generated tokens.")
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    turn_stop_strings: tuple[str, ...] = Field(
        default=(),
        description="Multi-turn episodes: an assistant turn ends when its text contains one of "
        "these (e.g. '</tool_call>'); the request then parks with its KV until the "
        "environment's reply is appended, instead of finishing.",
    )
    park_on_stop: bool = Field(
        default=False,
        description="Multi-turn episodes: a stop (end-of-sequence, a stop token or string) "
        "also parks the request, so the environment decides whether the episode ends; only "
        "the length limit finishes it on its own.",
    )


class ResumeState(Model):
    """Tokens already generated when a request is resubmitted (partial rollout baseline)."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    token_versions: tuple[int, ...] = Field(
        default=(), description="Policy version that produced each resumed token."
    )
    reprefilled_tokens: int = Field(default=0, ge=0, description="Re-prefilled so far.")
    engines: tuple[str, ...] = ()


class RolloutRequest(Event):
    """One completion to generate, tagged with the single policy version that must serve it."""

    kind: ClassVar[str] = "request"
    request_id: str = Field(min_length=1, max_length=256)
    prompt: Prompt
    prompt_token_ids: tuple[int, ...] = Field(default=(), description="Tokenized prompt.")
    group_id: str = Field(min_length=1, max_length=256, description="GRPO group (one prompt).")
    group_index: int = Field(ge=0, description="Index of this sample inside its group.")
    group_size: int = Field(default=1, ge=1)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    version: int = Field(ge=0, description="Policy version that must generate every token.")
    admitted_version: int | None = Field(
        default=None,
        ge=0,
        description="The dispatcher's tag at admission, never changed afterwards (the partial "
        "baseline retags ``version``); the staleness ledger and the learner's accounting key "
        "on it. None: equal to ``version``.",
    )
    priority: int = Field(default=0, description="Higher runs first; raised for urgent requests.")
    dispatched_at: float = Field(default_factory=now)
    resume: ResumeState | None = Field(
        default=None, description="Partial-rollout baseline only: tokens to re-prefill."
    )

    @property
    def dispatch_version(self) -> int:
        """The version the dispatcher admitted this request under (its ledger entry)."""
        return self.version if self.admitted_version is None else self.admitted_version


# --------------------------------------------------------------------------- trajectories


class Migration(Model):
    """One move of a running request between engines, with its KV cache."""

    source: str
    target: str
    at_token: int = Field(ge=0, description="Completion tokens generated before the move.")
    kv_bytes: int = Field(ge=0)
    seconds: float = Field(ge=0.0)
    transport: str = "objectstore"


class Turn(Model):
    """A span of the completion: model output, or tool/environment text (masked from loss)."""

    role: Literal["assistant", "tool", "user"]
    start: int = Field(ge=0, description="Index into completion_token_ids, inclusive.")
    end: int = Field(ge=0, description="Index into completion_token_ids, exclusive.")
    name: str = ""


class EpisodeRecord(Model):
    """What happened in a multi-turn episode with an environment (``dora.envs``)."""

    environment: str
    turns: int = Field(default=0, ge=0, description="Assistant turns the environment saw.")
    reward: float | None = Field(
        default=None, description="The environment's reward; None: the run's verifier scores."
    )
    turn_rewards: tuple[float | None, ...] = Field(
        default=(), description="The reward the environment gave with each turn's reply."
    )
    turn_metrics: tuple[dict[str, float], ...] = Field(
        default=(), description="Per-turn numbers (tool calls, parse errors, tool seconds)."
    )
    tool_calls: int = Field(default=0, ge=0)
    tool_call_errors: int = Field(default=0, ge=0, description="Malformed or invalid calls.")
    tool_seconds: float = Field(default=0.0, ge=0.0)
    attempts: int = Field(default=1, ge=1, description="2: retried on a fresh environment.")
    error: str = Field(default="", description="Why the episode failed; empty when it did not.")


class Timings(Model):
    """Where a trajectory's time went (seconds since the epoch, or durations in seconds)."""

    dispatched_at: float = 0.0
    started_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


FinishReason = Literal["stop", "length", "abort", "error"]


class Trajectory(Event):
    """A finished completion and everything needed to train on it and audit how it was made."""

    kind: ClassVar[str] = "trajectory"
    request: RolloutRequest
    version: int = Field(ge=0, description="Policy version of the tokens (dora: all of them).")
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = Field(description="Behaviour logprob of each completion token.")
    loss_mask: tuple[int, ...] = Field(description="1 where the model produced the token.")
    token_versions: tuple[int, ...] = Field(
        default=(), description="Per-token version when it differs (partial rollout); else empty."
    )
    turns: tuple[Turn, ...] = ()
    text: str = ""
    finish_reason: FinishReason
    engines: tuple[str, ...] = Field(default=(), description="Engines that decoded it, in order.")
    migrations: tuple[Migration, ...] = ()
    reprefilled_tokens: int = Field(default=0, ge=0, description="0 under dora.")
    logprobs_exact: bool = Field(
        default=True,
        description="False where the engine could not report the logprob of the distribution "
        "it sampled from (vLLM at a temperature other than 1, or with top-k/top-p): the "
        "tokens are still the sampler's, the logprobs are of the raw logits.",
    )
    timings: Timings = Field(default_factory=Timings)
    error: str = ""
    episode: EpisodeRecord | None = Field(
        default=None, description="Multi-turn episodes: the environment's record."
    )


class ScoredTrajectory(Event):
    """A trajectory with its reward."""

    kind: ClassVar[str] = "scored"
    trajectory: Trajectory
    reward: float
    correct: bool = False
    verifier: str = ""
    details: dict[str, str | int | float | bool] = Field(default_factory=dict)
    error: str = Field(default="", description="Verifier failure; reward is then 0.")


# --------------------------------------------------------------------------- environments


class ChatMessage(Model):
    """One OpenAI-format chat message (``tool_call_id`` and ``name`` for tool results)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=1_000_000)
    name: str | None = None
    tool_call_id: str | None = None


class EnvStep(Event):
    """Generator -> environment stage: start an episode (turn 0) or react to assistant turn
    ``turn``. Idempotent per (episode, attempt, turn): a redelivered step gets the reply
    already given and never runs a tool twice."""

    kind: ClassVar[str] = "env_step"
    episode_id: str = Field(min_length=1, max_length=256, description="The request id.")
    attempt: int = Field(default=0, ge=0, description="1: retried on a fresh environment.")
    turn: int = Field(ge=0, description="0: reset; k: the k-th assistant turn.")
    environment: str = Field(min_length=1, max_length=128)
    prompt: Prompt
    seed: int = Field(default=0, ge=0, lt=2**63)
    version: int = Field(ge=0, description="The policy version generating the episode.")
    engine: str = ""
    text: str = Field(default="", description="The assistant turn's text (turn > 0).")
    truncated: bool = Field(
        default=False,
        description="The turn was cut off by the length limit: a call in it is never run, "
        "and the episode ends after this step.",
    )


class EnvReply(Event):
    """Environment stage -> the engine holding the episode: the reply to one step."""

    kind: ClassVar[str] = "env_reply"
    episode_id: str = Field(min_length=1, max_length=256)
    attempt: int = Field(default=0, ge=0)
    turn: int = Field(ge=0)
    owner: str = Field(
        min_length=1, max_length=128, description="The environment replica holding it."
    )
    messages: tuple[ChatMessage, ...] = Field(
        default=(), description="Appended to the conversation (the opening ones at turn 0)."
    )
    done: bool = False
    reward: float | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    error: str = Field(default="", description="The environment failed: the episode ends.")
    lost: bool = Field(
        default=False,
        description="The replica does not hold this episode (it restarted): retry it on a "
        "fresh environment.",
    )


# --------------------------------------------------------------------------- weights


class BlobRef(Model):
    """Where a large binary lives (object store bucket/name, a shared directory path, or the
    learner's broadcast server ``HOST:PORT/<name>``)."""

    store: Literal["objectstore", "directory", "inline", "broadcast"] = "objectstore"
    bucket: str = ""
    name: str
    size: int = Field(ge=0)
    sha256: str = ""


class WeightVersion(Event):
    """A new policy version is available."""

    kind: ClassVar[str] = "weights"
    version: int = Field(ge=0)
    blob: BlobRef
    checksum: str = Field(description="sha256 of the blob bytes.")
    step: int = Field(ge=0, description="Learner step that produced it.")
    metrics: dict[str, float] = Field(default_factory=dict)


# --------------------------------------------------------------------------- engines


class RunningRequest(Model):
    """What the orchestrator needs to know of one request inside an engine."""

    request_id: str
    version: int
    generated: int = Field(ge=0, description="Completion tokens so far.")
    max_tokens: int = Field(ge=0)
    kv_blocks: int = Field(ge=0)
    dispatched_at: float = 0.0
    parked: bool = Field(
        default=False, description="A multi-turn episode waiting for its environment."
    )
    preempted: bool = Field(
        default=False,
        description="Waiting on its engine after a KV-full preemption: it holds no KV, and "
        "wherever it resumes it recomputes its context.",
    )


EngineState = Literal["idle", "loading", "serving", "draining", "stopped"]


class EngineStatus(Event):
    """Periodic report of an engine; the orchestrator decides from these."""

    kind: ClassVar[str] = "status"
    engine_id: str = Field(min_length=1, max_length=128)
    version: int | None = Field(description="Version whose weights are loaded; None if none.")
    assigned_version: int | None = None
    state: EngineState = "idle"
    running: int = Field(default=0, ge=0)
    waiting: int = Field(default=0, ge=0)
    parked: int = Field(default=0, ge=0, description="Episodes waiting for their environment.")
    kv_blocks_used: int = Field(default=0, ge=0)
    kv_blocks_total: int = Field(default=0, ge=0)
    block_size: int = Field(default=16, ge=1)
    tokens_per_s: float = Field(default=0.0, ge=0.0)
    max_running: int = Field(default=0, ge=0)
    engine_kind: str = Field(
        default="dora",
        description="'dora' (built-in) or 'vllm': requests migrate only between engines of "
        "the same kind (their KV layouts differ).",
    )
    requests: tuple[RunningRequest, ...] = ()


class AssignVersion(Event):
    """Engine: load this version's weights (when it holds no other version) and serve it."""

    kind: ClassVar[str] = "assign"
    command: Literal["assign"] = "assign"
    engine_id: str
    version: int = Field(ge=0)


class Drain(Event):
    """Engine: stop pulling new requests; finish (or hand over) the running ones."""

    kind: ClassVar[str] = "drain"
    command: Literal["drain"] = "drain"
    engine_id: str


class Migrate(Event):
    """Move running requests from ``source`` to ``target`` (same version) with their KV."""

    kind: ClassVar[str] = "migrate"
    command: Literal["migrate"] = "migrate"
    source: str
    target: str
    version: int = Field(ge=0)
    request_ids: tuple[str, ...]


class Prioritize(Event):
    """Raise the priority of urgent requests (they block the learner's staleness bound)."""

    kind: ClassVar[str] = "prioritize"
    command: Literal["prioritize"] = "prioritize"
    engine_id: str = ""
    request_ids: tuple[str, ...]
    priority: int = 10


class ExportRequest(Event):
    """Migrator -> source engine: stop decoding a request and store its snapshot as a blob."""

    kind: ClassVar[str] = "export"
    command: Literal["export"] = "export"
    engine_id: str
    request_id: str
    blob_name: str = Field(min_length=1, description="Object-store name to write the snapshot to.")


class ImportRequest(Event):
    """Migrator -> target engine: continue a request from a snapshot blob (no re-prefill)."""

    kind: ClassVar[str] = "import"
    command: Literal["import"] = "import"
    engine_id: str
    request_id: str
    blob: BlobRef
    lease: str = Field(
        default="", description="Ack token of the request's queue message; moves with it."
    )
    source: str = Field(default="", description="Engine the snapshot came from.")


class ReleaseExported(Event):
    """Migrator -> source engine: the target confirmed; free the exported request's blocks."""

    kind: ClassVar[str] = "release"
    command: Literal["release"] = "release"
    engine_id: str
    request_id: str


class RestoreExported(Event):
    """Migrator -> source engine: the migration failed; resume the request here, intact."""

    kind: ClassVar[str] = "restore"
    command: Literal["restore"] = "restore"
    engine_id: str
    request_id: str


ControlCommand = Annotated[
    AssignVersion
    | Drain
    | Migrate
    | Prioritize
    | ExportRequest
    | ImportRequest
    | ReleaseExported
    | RestoreExported,
    Field(discriminator="command"),
]


class ControlReply(Event):
    """An engine's or the migrator's answer to a control command (request-reply)."""

    kind: ClassVar[str] = "reply"
    ok: bool
    error: str = ""
    blob: BlobRef | None = Field(default=None, description="Export: where the snapshot went.")
    lease: str = Field(default="", description="Export: the request's ack token, handed over.")
    kv_bytes: int = Field(default=0, ge=0)
    at_token: int = Field(default=0, ge=0, description="Export: completion tokens so far.")


class KVSnapshot(Event):
    """Header of an exported running request; the KV blocks follow as raw tensor bytes."""

    kind: ClassVar[str] = "kvsnapshot"
    request: RolloutRequest
    version: int = Field(ge=0)
    model_fingerprint: str = Field(description="Hash of model config and weights version.")
    dtype: str
    block_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    num_blocks: int = Field(ge=0)
    num_cached_tokens: int = Field(ge=0, description="Tokens whose KV is in the blocks.")
    completion_token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    engines: tuple[str, ...] = ()
    migrations: tuple[Migration, ...] = ()
    started_at: float = 0.0
    first_token_at: float = 0.0
    kv_bytes: int = Field(ge=0, description="Length of the raw KV payload after the header.")
    kv_sha256: str = ""
    layout: str = Field(
        default="dora",
        description="Which engine's KV layout the payload is in: 'dora' (the built-in engine) "
        "or 'vllm:<attention backend>'; an engine refuses a layout it does not use.",
    )
    kv_shape: tuple[int, ...] = Field(
        default=(), description="The payload's tensor shape, for layouts other than 'dora'."
    )
    reprefilled_tokens: int = Field(
        default=0, ge=0, description="Tokens re-prefilled so far (preemption/resume)."
    )
    appended: tuple[Turn, ...] = Field(
        default=(), description="Multi-turn episodes: the completion spans the environment wrote."
    )
    turn_start: int = Field(default=0, ge=0, description="Where the current turn began.")
    recompute_tokens: int = Field(
        default=0,
        ge=0,
        description="Tokens that had KV before (a parked episode's evicted KV): computing "
        "them again counts as re-prefill on the target too.",
    )
    parked: bool = Field(
        default=False, description="Exported at a turn boundary, waiting for its environment."
    )
    parked_at: float = Field(
        default=0.0,
        ge=0.0,
        description="Wall time (unix s) it parked, when parked: how long its environment has "
        "been working when it arrives.",
    )


class MigrationRecord(Event):
    """Outcome of one migration attempt, published for audit and reports."""

    kind: ClassVar[str] = "migration"
    request_id: str
    source: str
    target: str
    version: int = Field(ge=0)
    ok: bool
    reason: str = ""
    kv_bytes: int = 0
    seconds: float = 0.0


class DeadLetter(Event):
    """An event a stage could not parse or handle, kept with the reason instead of dropped."""

    kind: ClassVar[str] = "deadletter"
    subject: str = Field(description="Subject the payload arrived on.")
    payload: str = Field(description="Original payload (utf-8, or base64 when not utf-8).")
    payload_encoding: Literal["utf-8", "base64"] = "utf-8"
    reason: str
    stage: str = ""
    deliveries: int = Field(default=1, ge=0)


class Metrics(Event):
    """A learner or rollout metrics record (slash-named scalars)."""

    kind: ClassVar[str] = "metrics"
    step: int = Field(ge=0)
    values: dict[str, float]
    consumed_groups: tuple[str, ...] = Field(
        default=(), description="Learner steps: the GRPO groups this step trained on."
    )


class VersionCounts(Model):
    """Per-version accounting of GRPO groups (a group = all samples of one prompt)."""

    version: int = Field(ge=0)
    dispatched: int = Field(default=0, ge=0, description="Groups tagged with this version.")
    finished: int = Field(default=0, ge=0, description="Groups whose every sample is scored.")
    consumed: int = Field(default=0, ge=0, description="Groups the learner trained on.")
    abandoned: int = Field(
        default=0,
        ge=0,
        description="Groups that can never finish: an engine refused one of their requests "
        "after dispatch. Nobody waits for them and nobody trains on them.",
    )


class Ledger(Event):
    """The dispatcher's staleness ledger (kept in the KV store under ``ledger``).

    The learner reads it to know which old groups are still unfinished, so it waits for an
    urgent group instead of stepping past its staleness deadline.
    """

    kind: ClassVar[str] = "ledger"
    learner_step: int = Field(ge=0, description="Learner steps taken when this was written.")
    staleness_bound: int = Field(ge=0, description="K: a group of version u trains at step <= u+K.")
    batch_groups: int = Field(ge=1, description="B: groups per learner step.")
    versions: tuple[VersionCounts, ...] = ()
    abandoned_groups: tuple[str, ...] = Field(
        default=(),
        description="The most recently abandoned group ids (see VersionCounts.abandoned): the "
        "learner drops the samples of theirs it holds.",
    )


WIRE_TYPES: tuple[type[Event], ...] = (
    Prompt,
    RolloutRequest,
    Trajectory,
    ScoredTrajectory,
    WeightVersion,
    EngineStatus,
    AssignVersion,
    Drain,
    Migrate,
    Prioritize,
    KVSnapshot,
    MigrationRecord,
    DeadLetter,
    Metrics,
    Ledger,
    ExportRequest,
    ImportRequest,
    ReleaseExported,
    RestoreExported,
    ControlReply,
    EnvStep,
    EnvReply,
)


def json_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema of every wire type, keyed by file name."""
    return {f"{cls.__name__}.json": cls.model_json_schema() for cls in WIRE_TYPES}
