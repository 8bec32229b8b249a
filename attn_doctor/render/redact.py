"""Who and where, kept out of what is pasted: home folders, hostnames, user names and the values of
environment variables whose names suggest a secret (`attn_doctor.machine.fingerprint.looks_secret`).

`redact` is pure: it replaces what an `Identity` names — the report's own machine's (its fingerprint records
them) together with the machine rendering it (`this_machine`) — plus what looks like it wherever it came from:
any /home/NAME, /Users/NAME or /root folder (and NAME as a user) and any NAME=value assignment of a secret-
looking NAME. The issue and markdown formats apply it to their rendered text; `report --no-redact` does not.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from attn_doctor.machine.fingerprint import EnvReport, collect_identity, looks_secret

HOME_MARK, HOST_MARK, USER_MARK, SECRET_MARK = "~", "[hostname]", "[user]", "[redacted]"

# Shorter names are not redacted as words: they would hit ordinary text ("vm", "ci"). Nor are account names
# that identify nobody (and are words of their own).
SHORTEST_NAME = 3
SHORTEST_SECRET = 8  # a secret variable's value shorter than this ("1", "true") is not looked for in the text
GENERIC_ACCOUNTS = frozenset({"root", "ubuntu", "user", "runner", "admin", "nobody", "jovyan", "ec2-user"})

# Home folders whoever they belong to: /home/NAME, /Users/NAME, C:\Users\NAME, /root.
_HOME_FOLDER = re.compile(r"(?<![\w.-])(?:/home/|/Users/|[A-Za-z]:\\Users\\)(?P<user>[\w.-]+)|(?<![\w.-])/root(?![\w.-])")
# An environment variable's NAME=value (upper case, as variables are named: `key=...` in code is not one), the
# value up to a space, a quote, a table's pipe, a tag or a code span ("\|", markdown-escaped, is part of it).
_ASSIGNMENT = re.compile(r"(?<![\w.])(?P<name>[A-Z_][A-Z0-9_]*)=(?P<value>(?:\\.|[^\s'\"`|<>\\])+)")


@dataclass(frozen=True)
class Identity:
    """What must not appear: hostnames, user names, home folders and secret values."""

    hostnames: frozenset[str] = frozenset()
    users: frozenset[str] = frozenset()
    homes: frozenset[str] = frozenset()
    secrets: frozenset[str] = frozenset()

    def __or__(self, other: Identity) -> Identity:
        return Identity(self.hostnames | other.hostnames, self.users | other.users, self.homes | other.homes,
                        self.secrets | other.secrets)


def identity_from(facts: Mapping[str, str], environ: Mapping[str, str]) -> Identity:
    """An Identity from a fingerprint's identity facts (hostname, user, home) and environment variables."""
    hostname = facts.get("hostname", "")
    return Identity(
        hostnames=frozenset(filter(None, {hostname, hostname.split(".")[0]})),
        users=frozenset(filter(None, {facts.get("user", "")})),
        homes=frozenset(home for home in {facts.get("home", "")} if home and home.strip("/\\")),
        secrets=frozenset(value for name, value in environ.items() if looks_secret(name) and len(value) >= SHORTEST_SECRET),
    )


def identity_of(env: EnvReport | None) -> Identity:
    """The identity a report's fingerprint recorded (nothing for documents written before it did)."""
    return identity_from(env.identity, env.env_vars) if env is not None else Identity()


def this_machine() -> Identity:
    """The identity of the machine rendering the report."""
    return identity_from(collect_identity(), os.environ)


def redact(text: str, identity: Identity) -> str:
    """`text` without the identity's secrets, home folders, hostnames and user names (nor any home folder or
    secret-looking assignment at all)."""
    for secret in sorted(identity.secrets, key=len, reverse=True):
        text = text.replace(secret, SECRET_MARK)
    text = _ASSIGNMENT.sub(lambda m: f"{m['name']}={SECRET_MARK}" if looks_secret(m["name"]) else m.group(0), text)
    users = set(identity.users) | {m["user"] for m in _HOME_FOLDER.finditer(text) if m["user"]}
    for home in sorted(identity.homes, key=len, reverse=True):
        text = re.sub(re.escape(home.rstrip("/\\")) + r"(?![\w.-])", HOME_MARK, text)
    text = _HOME_FOLDER.sub(HOME_MARK, text)
    for host in sorted(identity.hostnames, key=len, reverse=True):
        if len(host) >= SHORTEST_NAME:
            text = re.sub(r"(?<![\w.-])" + re.escape(host) + r"(?![\w-])", HOST_MARK, text, flags=re.IGNORECASE)
    for user in sorted(users, key=len, reverse=True):
        if len(user) >= SHORTEST_NAME and user not in GENERIC_ACCOUNTS:
            text = re.sub(r"(?<!\w)" + re.escape(user) + r"(?!\w)", USER_MARK, text)
    return text
