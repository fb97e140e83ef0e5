"""NATS subject matching (``*`` one token, ``>`` the rest), for the in-memory bus."""

from __future__ import annotations


def subject_matches(pattern: str, subject: str) -> bool:
    """True when ``subject`` is matched by ``pattern`` under NATS wildcard rules."""
    p_tokens = pattern.split(".")
    s_tokens = subject.split(".")
    for i, tok in enumerate(p_tokens):
        if tok == ">":
            return len(s_tokens) > i
        if i >= len(s_tokens):
            return False
        if tok != "*" and tok != s_tokens[i]:
            return False
    return len(p_tokens) == len(s_tokens)
