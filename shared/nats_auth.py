"""Who may say what on the bus: one NATS user per service role, with subject permissions.

Each role may publish only what that kind of service sends and subscribe only to what it reads,
plus its own inboxes (`_INBOX.<role>.>`: every connection of the role uses that prefix, see
shared.bus.NatsAuth), so:

- only engines publish heartbeats and KV events (a forged heartbeat cannot attract traffic);
- only gateways, schedulers and bus clients publish generate requests and cancels; only
  schedulers send work to engines;
- only control publishes deployment, pool and key changes; only control and gateways (the
  admin API) announce LoRA adapter changes;
- nobody but schedulers reads generate requests, nobody but engines the work sent to them, and
  a role's replies and streams only that role: a prompt or a stream cannot be read by another
  process, and the request ids a cancel needs (random, 128 bits) are never seen by other tenants.

`client` is the role of another team's service calling Strata over NATS (docs/protocol.md);
each client user gets the inbox prefix `_INBOX.<its name>`. `admin` may do anything (operators'
tools: `strata logs`, tests). `render_config` writes the nats-server `authorization` block;
`strata up` and the tests run it with fresh passwords, compose and Kubernetes with theirs.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from shared import protocol

# JetStream API calls a service makes itself: creating the log stream (shared.logstream).
_LOG_STREAM_API = [f"$JS.API.STREAM.CREATE.{protocol.LOGS_STREAM}", f"$JS.API.STREAM.INFO.{protocol.LOGS_STREAM}"]
_ENGINE_GENERATE = protocol.ENGINE_GENERATE_ALL
_ENGINE_KV_SNAPSHOT = protocol.ENGINE_KV_SNAPSHOT_ALL
_REPLIES = "_INBOX.>"  # answering a request, or streaming to a request's reply_to


def _logs(service: str) -> str:
    return protocol.logs(service, "*")


@dataclass(frozen=True)
class Role:
    name: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]

    def inbox(self, user: str | None = None) -> str:
        return f"_INBOX.{user or self.name}.>"


ROLES: dict[str, Role] = {r.name: r for r in (
    Role("engine",
         publish=(protocol.HEARTBEAT_ALL, protocol.KV_EVENTS_ALL, _REPLIES, _logs("engine"), *_LOG_STREAM_API),
         subscribe=(_ENGINE_GENERATE, _ENGINE_KV_SNAPSHOT, protocol.CANCEL, protocol.LORA_ADAPTERS_ALL)),
    Role("scheduler",
         publish=(_ENGINE_GENERATE, _ENGINE_KV_SNAPSHOT, protocol.CANCEL, protocol.SCHEDULER_STATS_ALL, _REPLIES,
                  _logs("scheduler"), *_LOG_STREAM_API),
         subscribe=(protocol.GENERATE, protocol.HEARTBEAT_ALL, protocol.KV_EVENTS_ALL, protocol.CANCEL,
                    protocol.CONTROL_DEPLOYMENTS)),
    Role("gateway",
         publish=(protocol.GENERATE, protocol.CANCEL, protocol.GATEWAY_STATS_ALL, protocol.LORA_ADAPTERS_ALL,
                  _logs("gateway"), *_LOG_STREAM_API),
         subscribe=(protocol.HEARTBEAT_ALL, protocol.SCHEDULER_STATS_ALL, protocol.CONTROL_DEPLOYMENTS,
                    protocol.CONTROL_KEYS, protocol.LORA_ADAPTERS_ALL)),
    Role("scaler",
         publish=(protocol.SCALER_STATUS, protocol.SCALER_POOLS, _logs("scaler"), *_LOG_STREAM_API),
         subscribe=(protocol.HEARTBEAT_ALL, protocol.SCHEDULER_STATS_ALL, protocol.CONTROL_DEPLOYMENTS,
                    protocol.CONTROL_POOLS)),
    Role("control",
         publish=(protocol.CONTROL_DEPLOYMENTS, protocol.CONTROL_KEYS, protocol.CONTROL_POOLS,
                  protocol.LORA_ADAPTERS_ALL, _logs("control"), *_LOG_STREAM_API),
         subscribe=(protocol.HEARTBEAT_ALL, protocol.SCHEDULER_STATS_ALL, protocol.SCALER_STATUS,
                    protocol.SCALER_POOLS, protocol.GATEWAY_STATS_ALL, protocol.CONTROL_DEPLOYMENTS,
                    protocol.CONTROL_KEYS)),
    Role("client", publish=(protocol.GENERATE, protocol.CANCEL), subscribe=()),
    Role("admin", publish=(">",), subscribe=(">",)),
)}
SERVICE_ROLES = ("engine", "scheduler", "gateway", "scaler", "control")


@dataclass(frozen=True)
class User:
    name: str
    role: str
    password: str

    @property
    def permissions(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        role = ROLES[self.role]
        inbox = () if self.role == "admin" else (role.inbox(self.name),)
        return role.publish, role.subscribe + inbox


def new_users(clients: tuple[str, ...] = ("client",)) -> dict[str, User]:
    """A user per service role (named after it), an admin, and the given bus clients, each with
    a fresh random password."""
    users = {role: User(role, role, secrets.token_urlsafe(24)) for role in (*SERVICE_ROLES, "admin")}
    for name in clients:
        users[name] = User(name, "client", secrets.token_urlsafe(24))
    return users


def _quoted(items) -> str:
    return "[" + ", ".join(f'"{s}"' for s in items) + "]"


def render_config(users: dict[str, User] | list[User], password_vars: bool = False) -> str:
    """The nats-server `authorization` block for these users. password_vars: each password is the
    environment variable STRATA_NATS_PASSWORD_<USER> of the server (compose, Kubernetes) instead
    of the literal."""
    lines = ["authorization {", "  users = ["]
    for user in (users.values() if isinstance(users, dict) else users):
        publish, subscribe = user.permissions
        password = f"${password_variable(user.name)}" if password_vars else f'"{user.password}"'
        lines += [f'    {{user: "{user.name}", password: {password}, permissions: {{',
                  f"      publish: {{allow: {_quoted(publish)}}}",
                  f"      subscribe: {{allow: {_quoted(subscribe)}}}",
                  "    }}"]
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def password_variable(user: str) -> str:
    return "STRATA_NATS_PASSWORD_" + "".join(c if c.isalnum() else "_" for c in user).upper()


def main() -> None:
    """`python -m shared.nats_auth [CLIENT ...]`: the authorization block for compose and
    Kubernetes (deploy/nats/nats.conf), each password read from the server's environment."""
    import sys

    users = new_users(tuple(sys.argv[1:]) or ("client",))
    sys.stdout.write(CONFIG_HEADER + render_config(users, password_vars=True))


CONFIG_HEADER = ("# Strata's NATS users, one per role, with their subject permissions: generated by\n"
                 "# `python -m shared.nats_auth` from shared/nats_auth.py (tests/deploy checks it is current).\n"
                 "# Each password is the server's environment variable STRATA_NATS_PASSWORD_<USER>.\n")


if __name__ == "__main__":
    main()
