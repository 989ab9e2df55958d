"""A small client of control's REST API, for the CLI and scripts (synchronous: urllib).

Where control is and which key to use: flags, else STRATA_CONTROL_URL / STRATA_API_KEY, else
the file `strata up` writes (STRATA_HOME/cli.json), so commands work right after `strata up`.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from shared.settings import default_home


class ControlError(Exception):
    def __init__(self, status: int, body: dict):
        self.status, self.body = status, body
        error = body.get("error", {}) if isinstance(body, dict) else {}
        details = "".join(f"\n  {e['field']}: {e['reason']}" for e in error.get("errors", []))
        message = error.get("message", str(body)) if not details else "invalid deployment spec:"
        super().__init__(f"{message}{details}" + ("" if status < 500 else f" (HTTP {status})"))


def cli_config_path(home: Path | None = None) -> Path:
    return (home or default_home()) / "cli.json"


def write_cli_config(control_url: str, api_key: str, home: Path | None = None, **urls: str) -> Path:
    """What `strata up` printed, for the commands that follow: control's URL and the admin key,
    and every other address (base_url, nats_url, redis_url, dashboard_url, log_dir)."""
    path = cli_config_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"control_url": control_url, "api_key": api_key, **urls}, indent=2))
    path.chmod(0o600)  # holds an admin key
    return path


def read_cli_config(home: Path | None = None) -> dict:
    path = cli_config_path(home)
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


class ControlClient:
    def __init__(self, url: str = "", api_key: str = "", timeout: float = 30.0, home: Path | None = None):
        path = cli_config_path(home)
        saved = read_cli_config(home)
        if url:
            self.url, self.source = url, "--control-url"
        elif os.environ.get("STRATA_CONTROL_URL"):
            self.url, self.source = os.environ["STRATA_CONTROL_URL"], "STRATA_CONTROL_URL"
        elif saved.get("control_url"):
            self.url, self.source = saved["control_url"], f"{path}, written by strata up"
        else:
            self.url, self.source = "http://127.0.0.1:8081", f"the default: no --control-url, STRATA_CONTROL_URL or {path}"
        self.url = self.url.rstrip("/")
        self.api_key = api_key or os.environ.get("STRATA_API_KEY") or saved.get("api_key", "")
        self.timeout = timeout

    def call(self, method: str, path: str, body: dict | None = None, text: str | None = None) -> dict:
        data = text.encode() if text is not None else json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.api_key}",
                   "Content-Type": "application/yaml" if text is not None else "application/json"}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                body = json.loads(exc.read() or b"{}")
            except ValueError:
                body = {"error": {"message": f"HTTP {exc.code}"}}
            raise ControlError(exc.code, body) from None
        except urllib.error.URLError as exc:
            raise ControlError(0, {"error": {"message": f"cannot reach control at {self.url} ({self.source}): "
                                                        f"{exc.reason}"}}) from None

    def deploy(self, spec_text: str) -> dict:
        return self.call("POST", "/api/v1/deployments", text=spec_text)

    def deployments(self) -> dict:
        return self.call("GET", "/api/v1/deployments")

    def status(self, name: str) -> dict:
        return self.call("GET", f"/api/v1/deployments/{name}")

    def canary(self, name: str, weight: int, revision: int | None = None) -> dict:
        return self.call("POST", f"/api/v1/deployments/{name}/canary",
                         {"weight": weight, **({"revision": revision} if revision else {})})

    def promote(self, name: str) -> dict:
        return self.call("POST", f"/api/v1/deployments/{name}/promote", {})

    def rollback(self, name: str, to: int | None = None) -> dict:
        return self.call("POST", f"/api/v1/deployments/{name}/rollback", {"to": to} if to else {})

    def history(self, name: str) -> dict:
        return self.call("GET", f"/api/v1/deployments/{name}/history")

    def delete(self, name: str) -> dict:
        return self.call("DELETE", f"/api/v1/deployments/{name}")

    def canary_status(self, name: str) -> dict:
        return self.call("GET", f"/api/v1/deployments/{name}/canary")

    def keys(self) -> dict:
        return self.call("GET", "/api/v1/keys")

    def revoke_key(self, key_id: str) -> dict:
        return self.call("DELETE", f"/api/v1/keys/{urllib.parse.quote(key_id, safe='')}")

    def create_key(self, name: str, rpm: int = 0, tpm: int = 0, priority: str = "standard",
                   admin: bool = False) -> dict:
        return self.call("POST", "/api/v1/keys", {"name": name, "rpm": rpm, "tpm": tpm, "priority": priority,
                                                  "admin": admin})
