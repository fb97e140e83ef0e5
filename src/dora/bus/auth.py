"""Who may do what on a run's NATS: per-run credentials and role permissions.

The embedded server admits no anonymous client. Each run gets one password per role, generated
into ``RUN_DIR/credentials/<role>.json`` (mode 0600) and kept for ``--resume``:

- ``pipeline``: dora's own process (its control of the run); all of the run's subjects.
- ``stage-<name>``: one per stage, which connects with it. It publishes only on the subject
  families the stage declares (``emits``, ``publishes``, and ``deadletter``) and writes only
  its declared KV keys: the learner alone announces weights and metrics, verifiers alone
  publish scored trajectories, generators alone trajectories.
- ``reader``: outside consumers. Reads every durable stream by sequence, subscribes to the live
  subjects, and attaches its own consumers to the replay stream only: it can neither take work
  from the pipeline's consumers nor hold back an interest stream. Publishes nothing.
- ``producer``: outside producers. Publishes prompts, and nothing else.

Each outside role gets its own inbox prefix, so it cannot read the replies other clients get.
"""

from __future__ import annotations

import json
import os
import secrets
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict

from dora.subjects import DURABLE_FAMILIES, Subjects

Role = Literal["pipeline", "reader", "producer"]
ROLES: tuple[Role, ...] = ("pipeline", "reader", "producer")
OUTSIDE_ROLES: tuple[Role, ...] = ("reader", "producer")
CREDENTIALS_DIR = "credentials"


class NatsAuth(BaseModel):
    """How one client authenticates: user/password (dora's credential files), or a NATS
    ``.creds`` file (JWT + nkey, for operator-managed servers); plus a CA for ``tls://``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user: str | None = None
    password: str | None = None
    creds_file: Path | None = None
    inbox_prefix: str | None = None
    ca_file: Path | None = None

    @classmethod
    def from_file(cls, path: Path, ca_file: Path | None = None) -> NatsAuth:
        """A dora credential file (JSON with ``user`` and ``password``) or a NATS ``.creds``."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"NATS credentials {path}: no such file")
        if path.suffix == ".creds":
            return cls(creds_file=path, ca_file=ca_file)
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            return cls(
                user=str(record["user"]),
                password=str(record["password"]),
                inbox_prefix=record.get("inbox_prefix"),
                ca_file=ca_file,
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"NATS credentials {path}: expected JSON with `user` and `password` "
                f"(or a NATS .creds file): {exc}"
            ) from exc

    @classmethod
    def from_options(cls, creds_file: Path | None, ca_file: Path | None) -> NatsAuth | None:
        """What ``--nats-creds`` and ``--nats-ca`` ask for (None: neither given)."""
        if creds_file is not None:
            return cls.from_file(creds_file, ca_file)
        return cls(ca_file=ca_file) if ca_file is not None else None

    def connect_options(self, url: str) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``; a ``tls://`` URL gets a verifying context."""
        options: dict[str, Any] = {}
        if self.user is not None:
            options["user"] = self.user
            options["password"] = self.password or ""
        if self.creds_file is not None:
            options["user_credentials"] = str(self.creds_file)
        if self.inbox_prefix:
            options["inbox_prefix"] = self.inbox_prefix
        options.update(tls_options(url, self.ca_file))
        return options


def tls_options(url: str, ca_file: Path | None = None) -> dict[str, Any]:
    """A verifying TLS context when the URL's scheme is ``tls`` (the CA: ``ca_file``, else the
    system's); nothing for ``nats://``."""
    if urlsplit(url if "://" in url else f"nats://{url}").scheme != "tls":
        return {}
    context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    return {"tls": context}


def _stream_names(subjects: Subjects) -> list[str]:
    """Every JetStream stream of the run: its families, the KV bucket, the object store."""
    names = [subjects.stream(f) for f in DURABLE_FAMILIES]
    return [*names, f"KV_{subjects.kv_bucket}", f"OBJ_{subjects.blob_bucket}"]


def inbox_prefix(role: Role) -> str | None:
    """Outside roles read replies on their own prefix only (None: nats-py's ``_INBOX``)."""
    return None if role == "pipeline" else f"_INBOX_{role}"


def permissions(role: Role, subjects: Subjects) -> dict[str, Any] | None:
    """The nats-server ``permissions`` block of ``role`` (None: unrestricted)."""
    if role == "pipeline":
        return None
    inbox = f"{inbox_prefix(role)}.>"
    if role == "producer":
        return {
            "publish": {
                "allow": [
                    subjects.prompts,
                    "$JS.API.INFO",
                    f"$JS.API.STREAM.INFO.{subjects.stream('prompts')}",
                ]
            },
            "subscribe": {"allow": [inbox]},
        }
    if role == "reader":
        replay = subjects.stream("replay")
        reads = []
        for stream in _stream_names(subjects):
            reads += [
                f"$JS.API.STREAM.INFO.{stream}",
                f"$JS.API.STREAM.MSG.GET.{stream}",
                f"$JS.API.DIRECT.GET.{stream}",
                f"$JS.API.DIRECT.GET.{stream}.>",
            ]
        consume = [
            f"$JS.API.CONSUMER.CREATE.{replay}",
            f"$JS.API.CONSUMER.CREATE.{replay}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{replay}.*",
            f"$JS.API.CONSUMER.INFO.{replay}.*",
            f"$JS.API.CONSUMER.MSG.NEXT.{replay}.*",
            f"$JS.API.CONSUMER.DELETE.{replay}.*",
            f"$JS.ACK.{replay}.>",
        ]
        return {
            "publish": {"allow": ["$JS.API.INFO", "$JS.API.STREAM.NAMES", *reads, *consume]},
            "subscribe": {
                "allow": [f"{subjects.root}.>", inbox],
                "deny": [f"{subjects.root}.control.>", f"{subjects.root}.rpc.>"],
            },
        }
    raise ValueError(f"unknown NATS role {role!r}; expected one of {', '.join(ROLES)}")


def stage_login(stage: str) -> str:
    return f"stage-{stage}"


@dataclass(frozen=True)
class StageGrant:
    """What one stage's login may write: subject families and KV keys."""

    families: frozenset[str]
    kv_keys: tuple[str, ...] = ()


def stage_permissions(subjects: Subjects, grant: StageGrant) -> dict[str, Any]:
    """A stage publishes on its families and writes its KV keys; JetStream's API (consumers,
    acks, its KV bucket and blob store) it uses freely, but it may not delete or reconfigure
    a stream or remove stored messages."""
    allow = []
    for family in sorted(grant.families):
        allow += [subjects.family(family), f"{subjects.family(family)}.>"]
    allow += [f"$KV.{subjects.kv_bucket}.{key}" for key in grant.kv_keys]
    allow += [f"$O.{subjects.blob_bucket}.>", "$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "_INBOX.>"]
    deny = ["$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.UPDATE.>", "$JS.API.STREAM.MSG.DELETE.>"]
    return {"publish": {"allow": allow, "deny": deny}}


class RunCredentials(BaseModel):
    """One password per login (role or stage) for one run."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    passwords: dict[str, str]

    @classmethod
    def load_or_create(
        cls, run_dir: Path, run_id: str, stages: Iterable[str] = ()
    ) -> RunCredentials:
        """The run folder's logins (a resumed run keeps its own); missing ones are created."""
        logins = [*ROLES, *(stage_login(name) for name in stages)]
        folder = Path(run_dir) / CREDENTIALS_DIR
        passwords: dict[str, str] = {}
        for login in logins:
            path = folder / f"{login}.json"
            if path.is_file():
                passwords[login] = NatsAuth.from_file(path).password or ""
        fresh = [login for login in logins if login not in passwords]
        passwords.update({login: secrets.token_urlsafe(24) for login in fresh})
        creds = cls(run_id=run_id, passwords=passwords)
        creds.save(run_dir, fresh)
        return creds

    def auth(self, login: str) -> NatsAuth:
        prefix = inbox_prefix(login) if login in ROLES else None  # type: ignore[arg-type]
        return NatsAuth(user=login, password=self.passwords[login], inbox_prefix=prefix)

    def path(self, run_dir: Path, login: str) -> Path:
        return Path(run_dir) / CREDENTIALS_DIR / f"{login}.json"

    def save(self, run_dir: Path, logins: Iterable[str]) -> None:
        folder = Path(run_dir) / CREDENTIALS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        for login in logins:
            record = {
                "user": login,
                "password": self.passwords[login],
                "inbox_prefix": self.auth(login).inbox_prefix,
                "run_id": self.run_id,
            }
            write_private(self.path(run_dir, login), json.dumps(record, indent=2) + "\n")

    def server_authorization(
        self, grants: Mapping[str, StageGrant] | None = None
    ) -> dict[str, Any]:
        """The nats-server ``authorization`` block: one user per login, no anonymous access.
        ``grants``: per stage name, what its login may write (a stage without one has no
        login)."""
        subjects = Subjects(self.run_id)
        users = []
        for role in ROLES:
            user: dict[str, Any] = {"user": role, "password": self.passwords[role]}
            perms = permissions(role, subjects)
            if perms is not None:
                user["permissions"] = perms
            users.append(user)
        for name, grant in sorted((grants or {}).items()):
            login = stage_login(name)
            users.append(
                {
                    "user": login,
                    "password": self.passwords[login],
                    "permissions": stage_permissions(subjects, grant),
                }
            )
        return {"users": users}


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (created 0600, never world-readable meanwhile)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(path, 0o600)


def required_permissions(subjects: Subjects) -> str:
    """What dora's own user needs on a NATS server it did not start (README, errors)."""
    return (
        f"dora's user needs publish and subscribe on {subjects.root}.>, $JS.API.>, $JS.ACK.>, "
        "$JS.FC.>, "
        f"$KV.{subjects.kv_bucket}.>, $O.{subjects.blob_bucket}.> and _INBOX.>"
    )
