"""An authenticated bus: the stack runs with one NATS user per role (shared.nats_auth), and a
process without the right credentials can neither connect, nor forge a heartbeat, a cancel or
a deployment change, nor read anyone's prompts or streams. NATS itself refuses: the services
never see the message. The documented example client (docs/protocol.md) streams with the
`client` role's credentials; TLS is used when configured."""

import asyncio
import re
import subprocess
import time
from pathlib import Path

import aiohttp
import nats
import pytest
from nats.errors import NoServersError

from services.control.client import ControlClient
from shared import protocol
from shared.bus import Bus, NatsAuth
from shared.localstack import free_port, nats_server_binary
from tests.fault.conftest import make_stack, stream_completion

MODEL = "tiny-llama"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    s = make_stack(tiny_model_dir, tmp_path_factory.mktemp("bus-auth-logs"), engines=1, control=True)
    yield s
    s.stop()


class Violations:
    """A connection's permission errors, as the server reports them."""

    def __init__(self):
        self.errors: list[str] = []

    async def record(self, exc: Exception) -> None:  # nats-py's error callback
        self.errors.append(str(exc))

    async def wait(self, needle: str, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(needle.lower() in e.lower() for e in self.errors):
            assert time.monotonic() < deadline, f"no permissions violation for {needle}: {self.errors}"
            await asyncio.sleep(0.05)


async def connect_as(stack, role: str, violations: Violations):
    auth = stack.infra.nats_auth(role)
    return await nats.connect(stack.infra.nats_url, error_cb=violations.record, allow_reconnect=False,
                              **auth.connect_options())


async def test_a_connection_without_credentials_is_refused(stack):
    for options in ({}, {"user": "engine", "password": "not-the-password"}):
        with pytest.raises((NoServersError, nats.errors.Error, OSError)):
            await nats.connect(stack.infra.nats_url, allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=0,
                               **options)


async def test_forged_heartbeat_cancel_and_deployment_change_are_refused_by_nats(stack):
    admin = await Bus.connect(stack.infra.nats_url_as("admin"), "observer")
    seen: dict[str, list] = {"heartbeat": [], "cancel": [], "deployments": [], "keys": []}

    def recorder(kind: str):
        async def record(msg) -> None:
            seen[kind].append(msg.data)
        return record
    await admin.nc.subscribe(protocol.heartbeat("forged-replica"), cb=recorder("heartbeat"))
    await admin.nc.subscribe(protocol.CANCEL, cb=recorder("cancel"))
    await admin.nc.subscribe(protocol.CONTROL_DEPLOYMENTS, cb=recorder("deployments"))
    await admin.nc.subscribe(protocol.CONTROL_KEYS, cb=recorder("keys"))
    await admin.nc.flush()
    violations = Violations()
    client = await connect_as(stack, "client", violations)  # another team's service: may only ask
    scaler_violations = Violations()
    scaler = await connect_as(stack, "scaler", scaler_violations)  # a service, but not one that cancels
    try:
        hb = protocol.Heartbeat(replica_id="forged-replica", model=MODEL, deployment=MODEL, state="ready",
                                max_num_seqs=1000, timestamp=time.time())
        for _ in range(3):
            await client.publish(protocol.heartbeat("forged-replica"), protocol.encode(hb))
        await client.publish(protocol.CONTROL_DEPLOYMENTS, protocol.encode(protocol.DeploymentChanged(
            name=MODEL, action="delete", generation=99)))
        # A forged revocation would lock a tenant out of every gateway's cache: only control sends one.
        await client.publish(protocol.CONTROL_KEYS, protocol.encode(protocol.KeyRevoked(key_hash="0" * 64)))
        await scaler.publish(protocol.CANCEL, protocol.encode(protocol.Cancel(request_id="someone", tenant="x")))
        await client.flush()
        await scaler.flush()
        await violations.wait(f'publish to "{protocol.heartbeat("forged-replica")}"')
        await violations.wait(f'publish to "{protocol.CONTROL_DEPLOYMENTS}"')
        await violations.wait(f'publish to "{protocol.CONTROL_KEYS}"')
        await scaler_violations.wait(f'publish to "{protocol.CANCEL}"')
        # Nor may it read what is not its own: requests to schedulers, gateways' streams.
        for subject in (protocol.GENERATE, "_INBOX.gateway.>", protocol.ENGINE_GENERATE_ALL, protocol.LOGS_ALL):
            await client.subscribe(subject)
            await client.flush()
            await violations.wait(f'subscription to "{subject}"')
        await asyncio.sleep(1.5)  # anything that got through would have arrived
    finally:
        await client.close()
        await scaler.close()
    assert seen == {"heartbeat": [], "cancel": [], "deployments": [], "keys": []}
    async with aiohttp.ClientSession() as http:  # the forged replica attracted nothing; the deployment stands
        outs = await asyncio.gather(*(stream_completion(http, stack.base_url, stack.api_key,
                                                        {"model": MODEL, "prompt": f"still {i}", "max_tokens": 4})
                                      for i in range(6)))
    assert all(o.ok and o.strata["replica_id"] == "engine-0" for o in outs), outs
    await admin.close()


async def test_every_service_runs_with_its_own_role(stack):
    """No service got more than its role: the stack serves, and no service's log reports a
    permissions violation (each publishes and subscribes only within its own permissions)."""
    async with aiohttp.ClientSession() as http:
        out = await stream_completion(http, stack.base_url, stack.api_key, {"model": MODEL, "prompt": "roles"})
        assert out.ok, out
        # A key control revokes is refused by the gateway at once: control may publish the
        # revocation and the gateway read it (its cache would keep the key for 10 s otherwise).
        control = ControlClient(stack.control_url, stack.api_key)
        created = await asyncio.to_thread(control.create_key, "roles-team")
        body = {"model": MODEL, "prompt": "key", "max_tokens": 1}
        assert (await stream_completion(http, stack.base_url, created["api_key"], body)).ok  # cached now
        await asyncio.to_thread(control.revoke_key, created["id"])
        refused_by = time.monotonic() + 2.0
        while (out := await stream_completion(http, stack.base_url, created["api_key"], body)).status != 401:
            assert time.monotonic() < refused_by, f"a revoked key still served after 2 s: {out}"
            await asyncio.sleep(0.05)
    for path in stack.log_dir.glob("*.log"):
        if path.name.startswith(("nats", "valkey")):
            continue
        text = path.read_text(errors="replace").lower()
        assert "permissions violation" not in text, (
            path.name, [line for line in text.splitlines() if "permissions violation" in line][:3])


def docs_example() -> str:
    text = DOCS.read_text()
    block = re.search(r"## Example: stream a completion with plain nats-py\s+```python\n(.*?)```", text, re.S)
    assert block, "docs/protocol.md lost its example client"
    return block.group(1).replace("asyncio.run(main())", "")


async def test_the_documented_client_streams_with_the_client_role_and_logprobs(stack, capsys):
    """docs/protocol.md's example, run as written (only its url, user and password filled in):
    its chunks carry logprobs, whose maps have integer keys."""
    namespace: dict = {}
    exec(compile(docs_example(), str(DOCS), "exec"), namespace)
    client = stack.infra.users["client"]
    await namespace["main"](stack.infra.nats_url, client.name, client.password)
    printed = capsys.readouterr().out
    assert printed, "the example printed no text"


def _make_tls(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 (openssl)."""
    ca_key, ca, key, csr, cert = (directory / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem"))
    run = lambda *args: subprocess.run(["openssl", *args], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "1",
        "-subj", "/CN=strata-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out", str(cert),
        "-days", "1", "-extfile", str(ext))
    return ca, cert, key


async def test_tls_when_the_server_has_it(tmp_path):
    ca, cert, key = _make_tls(tmp_path)
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(f'listen: "127.0.0.1:{port}"\ntls {{ cert_file: "{cert}", key_file: "{key}" }}\n'
                      f'authorization {{ users = [{{user: "gateway", password: "pw"}}] }}\n')
    proc = subprocess.Popen([nats_server_binary(), "-c", str(config)], stderr=subprocess.DEVNULL)
    try:
        url = f"tls://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                bus = await Bus.connect(url, "tls-test", connect_timeout=2,
                                        auth=NatsAuth("gateway", "pw", tls_ca=str(ca)))
                break
            except Exception:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
        got = asyncio.get_running_loop().create_future()
        async def on_message(msg) -> None:
            got.set_result(msg.data)
        await bus.nc.subscribe("_INBOX.gateway.x", cb=on_message)
        await bus.nc.publish("_INBOX.gateway.x", b"over tls")
        assert await asyncio.wait_for(got, 5) == b"over tls"
        assert bus.nc.connected_url.scheme == "tls"
        await bus.close()
        with pytest.raises(Exception):  # a client that does not trust the server's CA cannot connect
            await nats.connect(url, user="gateway", password="pw", allow_reconnect=False, connect_timeout=2,
                               max_reconnect_attempts=0)
    finally:
        proc.terminate()
        proc.wait(10)
