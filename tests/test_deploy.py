"""The deploy/ files agree with the code they deploy.

Docker, compose and Kubernetes cannot run here, so these tests read the files the way those tools
would and hold every number and path in them against the code: each deployment's environment
must load into valid `Settings`, probes must hit routes the app registers on the port it listens
on, scrape targets must be where `/metrics` is, and every series the Grafana dashboard queries must
appear in a real scrape of a running proxy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from capture_proxy.cli import _parser, main
from capture_proxy.core.token_in import SCALE_OUT_MISSING
from capture_proxy.server.app import create_admin_app, create_app
from capture_proxy.server.run import connection_budget
from capture_proxy.server.settings import ENV_PREFIX, Settings, SettingsError, load_settings
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.sinks.parquet._layout import DEDUP_WINDOW_S, GC_MARGIN_S
from capture_proxy.sinks.urls import parse_store_url
from tests.support.s3 import MotoS3

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SETTING_VARS = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(Settings)}
# Stands in for values a deployment reads from a secret store (shaped like `openssl rand -hex 32`).
SECRET = "9f2c4e6a8b0d1f3a5c7e9b1d3f5a7c9e0b2d4f6a8c0e2b4d6f8a0c2e4b6d8f0a"
#: What an operator gives the image at run time (deploy/Dockerfile bakes in no secret).
RUNTIME_SECRETS = {"CAPTURE_PROXY_ADMIN_TOKEN": SECRET}

Client = TestClient[web.Request, web.Application]


# ---- reading the files -------------------------------------------------------------------------


@functools.cache
def _yaml(rel: str) -> list[Any]:
    # Cached: pure-Python YAML parsing is slow, and no test changes what it reads.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return [d for d in yaml.load_all((DEPLOY / rel).read_text(), Loader=loader) if d is not None]


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        word, _, rest = (pending + line).partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def _docker(instruction: str) -> list[str]:
    return [args for word, args in _dockerfile() if word == instruction]


def _image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for args in _docker("ENV"):
        for pair in shlex.split(args):
            key, _, value = pair.partition("=")
            env[key] = value
    return env


def _interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} (required: a stand-in value)."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if env.get(name):
            return env[name]
        return arg if op.endswith("-") else ("required" if "?" in op else "")

    return re.sub(r"\$\{(\w+)(:?[-?])?([^}]*)\}", one, text)


def _settings(env: Mapping[str, str]) -> Settings:
    """The settings `capture-proxy serve` builds from this environment (and its errors)."""
    return load_settings(None, dict(env))


def _stop_budget(s: Settings) -> float:
    """Longest a SIGTERM'd proxy may take to exit 0: in-flight calls get `shutdown_timeout`, then
    the cleanup waits up to a stage timeout for background stages and another for the staging
    drain (capture_proxy/server/lifecycle.py). An orchestrator's kill deadline must exceed it."""
    return s.shutdown_timeout + 2 * s.stage_timeout


def _store_dir(settings: Settings) -> Path:
    store = parse_store_url(settings.store)
    assert store.kind in ("sqlite", "parquet"), settings.store
    assert "://" not in store.location, settings.store  # a local folder
    path = Path(store.location)
    return path.parent if store.kind == "sqlite" else path


def _get_routes(settings: Settings, *, admin: bool = False) -> set[str]:
    app = create_app(settings, sink=MemorySink())
    if admin:
        app = create_admin_app(app)
    return {r.resource.canonical for r in app.router.routes() if r.method == "GET" and r.resource}


# ---- every file parses, every variable is a setting --------------------------------------------


def test_every_yaml_file_parses_into_mappings() -> None:
    files = sorted(p.relative_to(DEPLOY) for p in DEPLOY.rglob("*.y*ml"))
    assert {str(p) for p in files} >= {
        "docker-compose.yml",
        "prometheus.yml",
        "kubernetes/vllm-capture.yaml",
        "kubernetes/secret.example.yaml",
        "kubernetes/networkpolicy.yaml",
        "kubernetes/maintenance.yaml",
    }
    for rel in files:
        docs = _yaml(str(rel))
        assert docs, rel
        assert all(isinstance(d, dict) for d in docs), rel


def test_every_capture_proxy_variable_in_deploy_is_a_setting() -> None:
    used: dict[str, set[str]] = {}
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            for name in re.findall(r"\bCAPTURE_PROXY_[A-Z0-9_]+", path.read_text()):
                used.setdefault(name, set()).add(str(path.relative_to(DEPLOY)))
    unknown = {name: files for name, files in used.items() if name not in SETTING_VARS}
    assert not unknown, f"not settings of capture-proxy serve: {unknown}"
    assert len(used) >= 10  # the scan saw the deployments' configuration


# ---- Dockerfile --------------------------------------------------------------------------------


def test_dockerfile_structure() -> None:
    assert _docker("FROM") == ["python:3.11-slim"]  # one stage, slim
    (user,) = _docker("USER")
    assert user not in ("root", "0")
    # The switch comes after every RUN: nothing is installed as that user, the image ends as it.
    words = [word for word, _ in _dockerfile()]
    assert "RUN" not in words[words.index("USER") :]
    (entry,) = _docker("ENTRYPOINT")
    assert json.loads(entry) == ["capture-proxy", "serve"]  # exec form: SIGTERM reaches it
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["capture-proxy"] == "capture_proxy.cli:main"
    assert _docker("STOPSIGNAL") in ([], ["SIGTERM"])
    assert any("pip install --no-cache-dir" in run for run in _docker("RUN"))

    settings = _settings({**_image_env(), **RUNTIME_SECRETS})
    assert settings.host == "0.0.0.0"
    assert settings.port == Settings().port
    exposed = [int(p) for args in _docker("EXPOSE") for p in args.split()]
    assert exposed == [settings.port, settings.admin_port]
    assert settings.upstream != "fake"  # a forgotten upstream must not stage fake answers
    (volume,) = _docker("VOLUME")
    assert _store_dir(settings) == Path(json.loads(volume)[0])

    (check,) = _docker("HEALTHCHECK")
    argv = json.loads(check.split(" CMD ", 1)[1])
    assert argv[0] == "python"
    assert "/healthz" in argv[-1]


def test_dockerfile_copies_every_package_folder() -> None:
    copied = {src for args in _docker("COPY") for src in args.split()[:-1]}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {"pyproject.toml", project["readme"], "capture_proxy"}
    assert needed <= copied
    assert all((ROOT / src).exists() for src in copied)


async def _run_check(argv: list[str], env: Mapping[str, str]) -> int:
    proc = await asyncio.create_subprocess_exec(
        *argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return await asyncio.wait_for(proc.wait(), timeout=30)


async def test_healthchecks_pass_on_a_running_proxy_and_fail_without_one(
    aiohttp_client: Callable[[web.Application], Awaitable[Client]],
) -> None:
    client = await aiohttp_client(create_app(Settings(upstream="fake"), sink=MemorySink()))
    port = str(client.port)
    (check,) = _docker("HEALTHCHECK")
    image_check = json.loads(check.split(" CMD ", 1)[1])
    assert image_check[0] == "python"
    image_check[0] = sys.executable
    assert await _run_check(image_check, {"CAPTURE_PROXY_PORT": port}) == 0
    # The compose healthcheck names the proxy's port itself: point it at the test server.
    test = _services()["capture-proxy"]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "python"]
    configured = _compose_settings().port
    assert f"127.0.0.1:{configured}/healthz" in test[-1]
    compose_check = [sys.executable, *test[2:-1], test[-1].replace(f":{configured}/", f":{port}/")]
    assert await _run_check(compose_check, {}) == 0
    await client.close()
    assert await _run_check(image_check, {"CAPTURE_PROXY_PORT": port}) != 0


# ---- docker compose ----------------------------------------------------------------------------

# What a user puts in deploy/.env: the required model and the secrets.
COMPOSE_ENV = {
    "VLLM_MODEL": "org/model",
    "VLLM_API_KEY": SECRET,
    "CAPTURE_PROXY_ADMIN_TOKEN": SECRET,
}


def _services() -> dict[str, Any]:
    (compose,) = _yaml("docker-compose.yml")
    services: dict[str, Any] = compose["services"]
    return services


def _compose_settings() -> Settings:
    env = _services()["capture-proxy"]["environment"]
    return _settings(
        {**_image_env(), **{k: _interpolate(str(v), COMPOSE_ENV) for k, v in env.items()}}
    )


def _vllm_flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _seconds(duration: str) -> int:
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert duration, duration
    assert parts, duration
    h, m, s = (int(x or 0) for x in parts.groups())
    return h * 3600 + m * 60 + s


def _published(spec: str) -> tuple[str, int]:
    """(host address, container port) of a compose `ports` entry."""
    parts = spec.split(":")
    return (parts[0] if len(parts) == 3 else "", int(parts[-1]))


def test_compose_runs_vllm_on_a_gpu_out_of_sandboxes_reach() -> None:
    vllm = _services()["vllm"]
    assert vllm["image"].startswith("vllm/vllm-openai:")
    (device,) = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert "gpu" in device["capabilities"]
    args = shlex.split(_interpolate(vllm["command"], COMPOSE_ENV))
    assert args[0] == COMPOSE_ENV["VLLM_MODEL"]  # the model comes from the environment
    assert _interpolate(vllm["command"], {}).startswith("required")  # and is required
    assert "ports" not in vllm  # nothing outside the compose network calls vLLM uncaptured
    assert _seconds(vllm["healthcheck"]["start_period"]) >= 600  # loading takes minutes
    assert _seconds(vllm["stop_grace_period"]) > int(_vllm_flag(args, "--shutdown-timeout"))


def test_compose_proxy_is_vllms_sidecar_with_its_store_on_a_volume() -> None:
    services = _services()
    proxy, s = services["capture-proxy"], _compose_settings()
    assert (DEPLOY / proxy["build"]["context"]).resolve() == ROOT
    assert (ROOT / proxy["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    # depends_on also orders shutdown: compose stops the proxy (it drains) before vLLM.
    assert "vllm" in proxy["depends_on"]
    vllm_args = shlex.split(_interpolate(services["vllm"]["command"], COMPOSE_ENV))
    assert s.upstream == f"http://vllm:{_vllm_flag(vllm_args, '--port')}"
    assert s.upstream_api_key == SECRET  # the key vLLM is given (VLLM_API_KEY)
    assert s.served_model == _vllm_flag(vllm_args, "--served-model-name")
    (compose,) = _yaml("docker-compose.yml")
    mounts = dict(reversed(m.split(":")[:2]) for m in proxy["volumes"])
    assert mounts[str(_store_dir(s))] in compose["volumes"]
    assert _seconds(proxy["stop_grace_period"]) > _stop_budget(s)


def test_compose_publishes_the_control_api_on_loopback_only() -> None:
    s = _compose_settings()
    assert s.admin_token == SECRET
    assert s.admin_port not in (0, s.port)
    published = [_published(p) for p in _services()["capture-proxy"]["ports"]]
    assert ("", s.port) in published  # sandboxes reach the proxy port
    assert {addr for addr, port in published if port == s.admin_port} == {"127.0.0.1"}
    assert {port for _, port in published} == {s.port, s.admin_port}


def test_prometheus_scrapes_the_proxy_where_its_metrics_are() -> None:
    (conf,) = _yaml("prometheus.yml")
    jobs = {job["job_name"]: job for job in conf["scrape_configs"]}
    s = _compose_settings()
    # Both on the control port (the sandboxes' port shows readiness only), vLLM's relayed.
    for job in (jobs["capture-proxy"], jobs["vllm"]):
        assert job.get("metrics_path", "/metrics") in _get_routes(s, admin=True)
        targets = [t for group in job["static_configs"] for t in group["targets"]]
        assert targets == [f"capture-proxy:{s.admin_port}"]
    assert jobs["vllm"]["metrics_path"] == "/metrics/upstream"
    assert "/metrics" not in _get_routes(s)
    assert urlsplit(s.upstream).netloc == "vllm:8000"  # relayed from there
    prometheus = _services()["prometheus"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]


# ---- Kubernetes --------------------------------------------------------------------------------


def _k8s(kind: str, file: str = "vllm-capture.yaml") -> list[dict[str, Any]]:
    return [d for d in _yaml(f"kubernetes/{file}") if d["kind"] == kind]


def _workload() -> dict[str, Any]:
    (workload,) = _k8s("StatefulSet") + _k8s("Deployment")
    return workload


def _pod() -> dict[str, Any]:
    spec: dict[str, Any] = _workload()["spec"]["template"]
    return spec


def _container(name: str) -> dict[str, Any]:
    (container,) = [c for c in _pod()["spec"]["containers"] if c["name"] == name]
    found: dict[str, Any] = container
    return found


def _k8s_env(container: Mapping[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it (secrets as SECRET)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "secretKeyRef" in source:
            value = SECRET
        elif "fieldRef" in source:
            value = f"<{source['fieldRef']['fieldPath']}>"
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], str(item["value"]))
        env[item["name"]] = value
    return env


def _k8s_settings() -> Settings:
    # The image's ENV (deploy/Dockerfile) under the container's env, as in the running pod.
    return _settings({**_image_env(), **_k8s_env(_container("capture-proxy"))})


def _port(container: Mapping[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return int(number)


def _pod_ports() -> dict[str, int]:
    return {
        p["name"]: int(p["containerPort"]) for c in _pod()["spec"]["containers"] for p in c["ports"]
    }


def _pre_stop_seconds(container: Mapping[str, Any]) -> int:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    if not command:
        return 0
    assert command[0] == "sleep", command
    return int(command[1])


def test_k8s_pod_runs_vllm_with_the_proxy_as_a_sidecar() -> None:
    vllm, proxy, s = _container("vllm"), _container("capture-proxy"), _k8s_settings()
    assert vllm["image"].startswith("vllm/vllm-openai:")
    assert "nvidia.com/gpu" in vllm["resources"]["limits"]
    vllm_port = _port(vllm, "vllm")
    assert s.upstream == f"http://127.0.0.1:{vllm_port}"  # same pod: the loopback
    assert _vllm_flag(vllm["args"], "--port") == str(vllm_port)
    assert s.served_model == _vllm_flag(vllm["args"], "--served-model-name")
    assert s.host == "0.0.0.0"
    assert _port(proxy, "http") == s.port
    assert _port(proxy, "admin") == s.admin_port != s.port
    assert s.admin_token == SECRET
    assert s.upstream_api_key == SECRET
    # vLLM requires the very key the proxy sends: one Secret entry for both.
    key_refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for c in (vllm, proxy)
        for e in c["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert key_refs["VLLM_API_KEY"] == key_refs["CAPTURE_PROXY_UPSTREAM_API_KEY"]


def test_k8s_probes_hit_routes_the_proxy_registers_on_its_port() -> None:
    proxy, s = _container("capture-proxy"), _k8s_settings()
    routes = _get_routes(s)
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = proxy[kind]["httpGet"]
        assert probe["path"] in routes, (kind, probe)
        assert _port(proxy, probe["port"]) == s.port, kind
    vllm = _container("vllm")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert _port(vllm, vllm[kind]["httpGet"]["port"]) == _port(vllm, "vllm"), kind
    startup = vllm["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # loading takes minutes


#: The object-store credentials a fleet's pods read from the Secret (docs/storage.md,
#: "Configuration": the standard variables pyarrow and obstore both read).
AWS_SECRET_VARS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


def _on_object_storage(store_url: str) -> bool:
    store = parse_store_url(store_url)
    return store.kind == "parquet" and urlsplit(store.location).scheme in ("s3", "gs", "az")


def _secret_refs(container: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    return {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def test_k8s_fleet_writes_one_object_store_dataset() -> None:
    # The example is the fleet: several pods, every proxy staging into one dataset on object
    # storage (the one store several writers may share), credentials from the Secret.
    assert _workload()["spec"]["replicas"] >= 2
    s, proxy = _k8s_settings(), _container("capture-proxy")
    assert _on_object_storage(s.store), s.store
    assert "metadata.name" not in s.store  # one dataset, not one per pod ($(POD_NAME))
    env = _k8s_env(proxy)
    assert _secret_refs(proxy).keys() >= AWS_SECRET_VARS
    assert env["AWS_REGION"]
    # Nothing of the store is in the pod: the proxy writes only /tmp under a read-only root.
    assert proxy["securityContext"]["readOnlyRootFilesystem"] is True
    assert [m["mountPath"] for m in proxy["volumeMounts"]] == ["/tmp"]
    assert "volumeClaimTemplates" not in _workload()["spec"]
    uid = re.search(r"--uid (\d+)", " ".join(_docker("RUN")))
    gid = re.search(r"--gid (\d+)", " ".join(_docker("RUN")))
    assert uid
    assert gid
    assert proxy["securityContext"]["runAsUser"] == int(uid.group(1))
    assert proxy["securityContext"]["runAsNonRoot"] is True
    assert _pod()["spec"]["securityContext"]["fsGroup"] == int(gid.group(1))


def test_k8s_single_pod_variant_note_names_settings_and_the_one_writer_rule() -> None:
    # The header says how to run one pod on SQLite instead; what it names must be real.
    header = "\n".join(
        line[1:].strip()
        for line in (DEPLOY / "kubernetes" / "vllm-capture.yaml").read_text().splitlines()
        if line.startswith("#")
    )
    assert "replicas: 1" in header
    (sqlite_url,) = re.findall(r"sqlite:////\S+\b", header)
    variant = _settings(
        {**_image_env(), **_k8s_env(_container("capture-proxy")), "CAPTURE_PROXY_STORE": sqlite_url}
    )
    assert parse_store_url(variant.store).kind == "sqlite"
    assert _store_dir(variant) == Path("/data")
    assert "volumeClaimTemplate" in header
    assert "one writing proxy" in header


def test_k8s_services_expose_the_proxy_never_vllm() -> None:
    labels = _pod()["metadata"]["labels"]
    proxy_ports = {
        _port(_container("capture-proxy"), p["name"]) for p in _container("capture-proxy")["ports"]
    }
    s = _k8s_settings()
    front = []
    for service in _k8s("Service"):
        spec = service["spec"]
        assert spec["selector"].items() <= labels.items()
        for port in spec["ports"]:
            target = port.get("targetPort", port["port"])
            assert _port(_container("capture-proxy"), target) in proxy_ports, port
        if spec.get("clusterIP") != "None":
            front += [_port(_container("capture-proxy"), p["targetPort"]) for p in spec["ports"]]
    assert front == [s.port]  # the Service sandboxes use carries the proxy port alone
    assert _workload()["spec"].get("serviceName") in {
        d["metadata"]["name"] for d in _k8s("Service")
    } | {None}


def test_k8s_secret_holds_every_key_the_pods_read() -> None:
    (secret,) = _k8s("Secret", "secret.example.yaml")
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    pods = [_pod()] + [_maintenance_pod(name) for name in MAINTENANCE]
    for container in [c for pod in pods for c in pod["spec"]["containers"]]:
        for item in container.get("env", []):
            ref = item.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert (ref["name"], ref["key"]) in {(secret["metadata"]["name"], k) for k in keys}


def test_k8s_termination_leaves_time_to_drain_in_flight_calls() -> None:
    s, proxy, vllm = _k8s_settings(), _container("capture-proxy"), _container("vllm")
    grace = _pod()["spec"]["terminationGracePeriodSeconds"]
    proxy_calls_done = _pre_stop_seconds(proxy) + s.shutdown_timeout
    vllm_drain = _pre_stop_seconds(vllm) + int(_vllm_flag(vllm["args"], "--shutdown-timeout"))
    assert _pre_stop_seconds(proxy) > 0  # the Service forgets the pod before the proxy stops
    # vLLM keeps answering as long as the proxy may still be finishing calls...
    assert vllm_drain >= proxy_calls_done
    # ...and SIGKILL comes after both, including the last calls' staging.
    assert grace > max(_pre_stop_seconds(proxy) + _stop_budget(s), vllm_drain)


def test_k8s_prometheus_annotations_point_at_metrics() -> None:
    notes, s = _pod()["metadata"]["annotations"], _k8s_settings()
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == str(s.admin_port)
    assert notes["prometheus.io/path"] in _get_routes(s, admin=True)


def test_k8s_network_policy_keeps_the_control_api_and_vllm_from_sandboxes() -> None:
    (policy,) = _k8s("NetworkPolicy", "networkpolicy.yaml")
    s, ports = _k8s_settings(), _pod_ports()
    assert (
        policy["spec"]["podSelector"]["matchLabels"].items() <= _pod()["metadata"]["labels"].items()
    )
    for rule in policy["spec"]["ingress"]:
        opened = {
            ports[p["port"]] if isinstance(p["port"], str) else p["port"] for p in rule["ports"]
        }
        if not rule.get("from"):  # open to every pod: sandboxes
            assert opened == {s.port}
        else:
            assert s.port not in opened
    admin_rules = [
        r for r in policy["spec"]["ingress"] if any(p["port"] == "admin" for p in r["ports"])
    ]
    assert admin_rules
    assert all(r.get("from") for r in admin_rules)


# ---- Kubernetes: maintenance of the fleet's dataset ---------------------------------------------


#: The maintenance CronJobs and the one command each runs.
MAINTENANCE = {"capture-compact": "compact", "capture-gc": "gc"}


def _maintenance(name: str) -> dict[str, Any]:
    (job,) = [j for j in _k8s("CronJob", "maintenance.yaml") if j["metadata"]["name"] == name]
    return job


def _maintenance_pod(name: str) -> dict[str, Any]:
    pod: dict[str, Any] = _maintenance(name)["spec"]["jobTemplate"]["spec"]["template"]
    return pod


def _maintenance_script(name: str) -> tuple[list[str], str]:
    """(the `sh -c` argv before the script, the script) the CronJob's container runs."""
    (container,) = _maintenance_pod(name)["spec"]["containers"]
    *shell, script = container["command"]
    return shell, script


def test_k8s_maintenance_runs_on_the_fleets_dataset_with_its_image_and_credentials() -> None:
    assert {j["metadata"]["name"] for j in _k8s("CronJob", "maintenance.yaml")} == set(MAINTENANCE)
    proxy, fleet = _container("capture-proxy"), _k8s_settings()
    for name, command in MAINTENANCE.items():
        job, pod = _maintenance(name), _maintenance_pod(name)
        (container,) = pod["spec"]["containers"]
        assert container["image"] == proxy["image"]
        env = _k8s_env(container)
        assert env["CAPTURE_PROXY_STORE"] == fleet.store  # the dataset the proxies write
        assert (
            _secret_refs(container).items()
            >= {k: v for k, v in _secret_refs(proxy).items() if k.startswith("AWS_")}.items()
        )
        assert env["AWS_REGION"] == _k8s_env(proxy)["AWS_REGION"]
        # One run at a time is the lease's job; Kubernetes should not queue more behind it.
        assert job["spec"]["concurrencyPolicy"] == "Forbid"
        assert pod["spec"]["restartPolicy"] in ("OnFailure", "Never")
        assert container["securityContext"]["runAsUser"] == proxy["securityContext"]["runAsUser"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        # One command each, with arguments the CLI accepts.
        shell, script = _maintenance_script(name)
        assert shell == ["sh", "-c"]
        steps = [shlex.split(step) for step in script.split("&&")]
        assert [step[:2] for step in steps] == [["capture-proxy", command]]
        args = _parser().parse_args(
            [a.replace("$CAPTURE_PROXY_STORE", fleet.store) for a in steps[0][1:]]
        )
        assert args.store == fleet.store


def _every_minutes(schedule: str) -> int | None:
    """How many minutes apart a cron schedule's runs are, when it runs every N minutes of every
    hour of every day (``* * * * *``, ``*/5 * * * *``); None otherwise (a daily one, say)."""
    minute, *rest = schedule.split()
    if rest != ["*"] * 4:
        return None
    if minute == "*":
        return 1
    m = re.fullmatch(r"\*/(\d+)", minute)
    return int(m.group(1)) if m else None


def test_k8s_compaction_runs_every_minute_so_a_restart_reads_a_minutes_units() -> None:
    # A restarted proxy reads the units committed since the last compaction one by one: the
    # schedule bounds that tail (docs/storage.md says what it costs at this schedule).
    compact, gc = _maintenance("capture-compact"), _maintenance("capture-gc")
    every = _every_minutes(compact["spec"]["schedule"])
    assert every == 1
    # A run that failed (the lease held by gc) is not retried: the next minute's run does it.
    assert compact["spec"]["jobTemplate"]["spec"]["backoffLimit"] == 0
    # A run missed by more than the interval is skipped rather than started late beside the next.
    assert compact["spec"]["startingDeadlineSeconds"] < every * 60
    # gc stays nightly, and waits for a compaction holding the lease instead of failing.
    assert _every_minutes(gc["spec"]["schedule"]) is None
    _, script = _maintenance_script("capture-gc")
    fleet = _k8s_settings()
    args = _parser().parse_args(
        [a.replace("$CAPTURE_PROXY_STORE", fleet.store) for a in shlex.split(script)[1:]]
    )
    assert args.wait >= 60_000  # ms: longer than a compaction of a minute's units takes
    docs = re.sub(r"\s+", " ", (ROOT / "docs" / "storage.md").read_text())
    assert "`capture-proxy compact` every minute" in docs


async def test_k8s_maintenance_scripts_compact_and_collect_while_a_proxy_writes(
    aiohttp_client: Callable[[web.Application], Awaitable[Client]], moto_s3: MotoS3
) -> None:
    # The CronJobs' own scripts, run by a shell against a dataset on a real S3 API (moto) that a
    # running proxy stages into before, during and after it: both steps succeed (exit 0) and the
    # proxy goes on staging.
    store = moto_s3.url()
    app = create_app(Settings(upstream="fake", store=store, min_free_disk_mb=0))
    client = await aiohttp_client(app)
    body = {"model": "policy", "messages": [{"role": "user", "content": "hello"}]}

    async def call(rollout: str) -> None:
        resp = await client.post(f"/r/{rollout}/v1/chat/completions", json=body)
        assert resp.status == 200
        assert resp.headers["X-Capture-Status"] == "staged"

    for n in range(3):
        await call(f"before-{n}")
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        **moto_s3.env,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "CAPTURE_PROXY_STORE": store,
    }
    outputs = []
    for name in MAINTENANCE:  # compaction, then gc, each its CronJob's own script
        shell, script = _maintenance_script(name)
        proc = await asyncio.create_subprocess_exec(
            *shell, script, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        during = asyncio.ensure_future(
            asyncio.gather(*(call(f"during-{name}-{n}") for n in range(3)))
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
        await during
        assert proc.returncode == 0, err.decode()
        outputs.append(out.decode())
    assert "unit(s) ->" in outputs[0]  # compact's summary
    assert "record(s) unchanged" in outputs[0]
    await call("after")
    await client.close()


def test_deploy_readme_states_the_gc_window_rule_of_the_code() -> None:
    # gc beside writers keeps what a proxy may still refer to: the README says how long, and the
    # proxies need not be stopped for it any more.
    readme = (DEPLOY / "README.md").read_text()
    prose = re.sub(r"\s+", " ", readme)
    minutes = int((DEDUP_WINDOW_S + GC_MARGIN_S) // 60)
    assert f"committed more than {minutes} minutes ago" in prose
    assert "stop the proxies before" not in prose.lower()
    assert "maintenance lease" in prose


# ---- systemd -----------------------------------------------------------------------------------

UNIT = DEPLOY / "systemd" / "capture-proxy.service"


def _unit() -> dict[str, dict[str, list[str]]]:
    """Section -> key -> values (systemd allows a key more than once)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        else:
            key, _, value = line.partition("=")
            current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _env_file(*, filled_in: bool = True) -> dict[str, str]:
    """The example EnvironmentFile; `filled_in`: with the admin token the operator must add."""
    env = {}
    for raw in (DEPLOY / "systemd" / "capture-proxy.env.example").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    if filled_in:
        assert env["CAPTURE_PROXY_ADMIN_TOKEN"] == ""  # the example ships no token to copy
        env.update(RUNTIME_SECRETS)
    return env


def test_systemd_unit_runs_capture_proxy_serve_in_a_sandbox() -> None:
    service = _unit()["Service"]
    (exec_start,) = service["ExecStart"]
    argv = shlex.split(exec_start)
    assert Path(argv[0]).name == "capture-proxy"
    assert argv[1:] == ["serve"]
    assert service["EnvironmentFile"]
    assert service["Restart"] == ["on-failure"]
    assert service["KillSignal"] == ["SIGTERM"]
    assert service["NoNewPrivileges"] == ["yes"]
    assert service["ProtectSystem"] == ["strict"]
    assert service["User"] != ["root"]
    # The example ships no token: refused at start, naming the setting, until the operator fills
    # it in; a placeholder would be refused too.
    with pytest.raises(SettingsError, match="admin-token"):
        _settings(_env_file(filled_in=False))
    env = _env_file()
    with pytest.raises(SettingsError, match="placeholder"):
        _settings({**env, f"{ENV_PREFIX}ADMIN_TOKEN": "replace-with-output-of-openssl-rand-hex-32"})
    s = _settings({**env, f"{ENV_PREFIX}ADMIN_TOKEN": "9f2c71be0d4a58e3b6c1f07a2d9e4b85"})
    writable = [Path(p) for value in service["ReadWritePaths"] for p in value.split()]
    assert any(_store_dir(s).is_relative_to(p) for p in writable)
    assert _seconds(service["TimeoutStopSec"][0]) > _stop_budget(s)


def test_a_settings_error_exits_2_which_the_unit_does_not_restart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    assert _unit()["Service"]["RestartPreventExitStatus"] == ["2"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_accepts_every_directive_of_the_unit(tmp_path: Path) -> None:
    # verify checks that ExecStart exists: point it at this checkout's capture-proxy.
    here = Path(sys.executable).with_name("capture-proxy")
    unit = tmp_path / "capture-proxy.service"
    unit.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={here}", UNIT.read_text(), flags=re.M))
    out = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert out.stdout + out.stderr == "", out.stdout + out.stderr


# ---- Grafana -----------------------------------------------------------------------------------

DASHBOARD = DEPLOY / "grafana" / "capture-proxy.json"
PROMQL_FUNCTIONS = {"sum", "min", "max", "rate", "increase", "histogram_quantile", "label_values"}
PROMQL_KEYWORDS = {"by", "without", "and", "or", "unless", "bool"}
# Series Prometheus adds to every target itself; everything else must come from /metrics.
SYNTHETIC = {"up": {"job", "instance"}}


def _panels() -> Iterator[dict[str, Any]]:
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _queries() -> list[str]:
    exprs = [t["expr"] for p in _panels() for t in p.get("targets", [])]
    templating = json.loads(DASHBOARD.read_text())["templating"]["list"]
    exprs += [v["definition"] for v in templating if v["type"] == "query"]
    return exprs


def _promql(expr: str) -> tuple[dict[str, set[str]], set[str], set[str]]:
    """(metric -> label names matched on it, grouping labels, functions) of one query."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\[[^\]]*\]", "", text)
    metrics: dict[str, set[str]] = {}
    for name, matchers in re.findall(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}", text):
        metrics[name] = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    text = re.sub(r"\{[^}]*\}", "", text)
    grouping: set[str] = set()
    for labels in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", text):
        grouping |= {x.strip() for x in labels.split(",") if x.strip()}
    text = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", text)
    label_values = re.match(r"label_values\((.*),\s*(\w+)\)$", text)
    if label_values:  # Grafana's variable query: label_values(series, label)
        grouping.add(label_values.group(2))
        text = f"label_values({label_values.group(1)})"
    text = re.sub(r"\$\w+", "", text)
    functions = set(re.findall(r"(?<![\w.])([A-Za-z_][\w:]*)\s*\(", text))
    for word in re.findall(r"(?<![\w.$:])([A-Za-z_:][\w:]*)(?![\w:]|\s*\()", text):
        if word not in PROMQL_KEYWORDS:
            metrics.setdefault(word, set())
    return metrics, grouping, functions


def test_dashboard_structure() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"]
    assert dashboard["title"]
    assert dashboard["schemaVersion"] >= 36
    panels = list(_panels())
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["gridPos"]["w"] > 0, panel["title"]
        assert panel["datasource"]["uid"].strip("${}") in variables, panel["title"]


async def test_dashboard_queries_only_series_a_running_proxy_exports(
    aiohttp_client: Callable[[web.Application], Awaitable[Client]], tmp_path: Path
) -> None:
    # The store the deployments use (SQLite), so the sink's own series are in the scrape too.
    store = f"sqlite:///{tmp_path / 'capture.db'}"
    app = create_app(Settings(upstream="fake", store=store, min_free_disk_mb=0))
    client = await aiohttp_client(app)
    body = {"model": "policy", "messages": [{"role": "user", "content": "hello"}]}
    resp = await client.post("/r/deploy/v1/chat/completions", json=body)
    assert resp.status == 200
    assert resp.headers["X-Capture-Status"] == "staged"
    scrape = await (await client.get("/metrics")).text()
    labels: dict[str, set[str]] = dict(SYNTHETIC)
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            labels.setdefault(sample.name, {"job", "instance"}).update(sample.labels)
    assert labels["capture_proxy_calls_total"] >= {"outcome", "reason"}  # the call was counted

    used: set[str] = set()
    for expr in _queries():
        metrics, grouping, functions = _promql(expr)
        assert functions <= PROMQL_FUNCTIONS, (expr, functions - PROMQL_FUNCTIONS)
        assert metrics, expr
        for name, matched in metrics.items():
            assert name in labels, f"{name} is not in a /metrics scrape ({expr})"
            assert matched <= labels[name], (expr, matched - labels[name])
        known = set().union(*(labels[name] for name in metrics))
        assert grouping <= known, (expr, grouping - known)
        used |= set(metrics)
    # The panels the operators asked for are there.
    assert {
        "capture_proxy_requests_total",
        "capture_proxy_calls_total",
        "capture_proxy_upstream_duration_seconds_bucket",
        "capture_proxy_overhead_duration_seconds_bucket",
        "capture_proxy_staged_tokens_total",
        "capture_proxy_pending_stages",
        "capture_proxy_sink_queue_depth",
        "capture_proxy_inflight_calls",
        "capture_proxy_ledger_held_entries",
    } <= used


def test_promql_reader_sees_metrics_labels_and_functions() -> None:
    # The reader above is what makes the dashboard test able to fail: check it on a known query.
    metrics, grouping, functions = _promql(
        'histogram_quantile(0.99, sum by (le, route) (rate(capture_proxy_x_bucket{job=~"$job",'
        ' route!="a{b}"}[$__rate_interval]))) / on() capture_proxy_y and typo_metric'
    )
    assert metrics == {
        "capture_proxy_x_bucket": {"job", "route"},
        "capture_proxy_y": set(),
        "typo_metric": set(),
    }
    assert grouping == {"le", "route"}
    assert functions == {"histogram_quantile", "sum", "rate", "on"}


# ---- safe for hostile sandboxes (docs/security.md) ---------------------------------------------

DEPLOYMENTS: dict[str, Callable[[], Settings]] = {
    "image": lambda: _settings({**_image_env(), **RUNTIME_SECRETS}),
    "compose": _compose_settings,
    "kubernetes": _k8s_settings,
    "systemd": lambda: _settings(_env_file()),
}


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_every_deployment_is_safe_for_hostile_sandboxes(name: str) -> None:
    s = DEPLOYMENTS[name]()
    # A sandbox can write only into the rollout whose key it holds, and must name it.
    assert s.require_rollout_keys, name
    assert s.require_rollout_id, name
    # The control API (which mints keys) is on its own port only, behind a token from a secret.
    assert s.admin_token == SECRET, name
    assert s.admin_port not in (0, s.port), name
    app = create_app(s, sink=MemorySink())
    main_routes = {r.resource.canonical for r in app.router.routes() if r.resource}
    assert not [r for r in main_routes if r.startswith("/admin")], name
    # Slow and greedy clients are bounded (the defaults: these files do not switch them off).
    assert s.max_connections > 0, name
    for deadline in ("client_header_timeout", "client_body_timeout", "client_write_timeout"):
        assert 0 < getattr(s, deadline) <= 300, (name, deadline)


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_every_deployment_keeps_one_sandbox_from_denying_service_to_the_others(name: str) -> None:
    # Issue 27: with the shipped files one keyed rollout had 1,000 streams admitted at once, and
    # one address's idle connections filled the whole connection cap.
    s = DEPLOYMENTS[name]()
    assert 0 < s.max_inflight_per_rollout <= 16, name
    # Issue 27's soak: past a busy proxy's threshold a flooding rollout waits its turn.
    assert 0 < s.fair_share_inflight <= 64, name
    assert s.fair_share_queue > 0, name
    assert 0 < s.max_connections_per_address <= s.max_connections // 16, name
    # Issue 27's soak: a sandbox opening and dropping connections in a loop is refused at accept.
    assert 0 < s.max_connection_rate_per_address <= 256, name
    assert 0 < s.max_json_items <= 262_144, name
    assert 0 < s.max_decoding_bytes <= 4 * s.max_body_bytes, name
    # Every file says it, not only the proxy's defaults (an operator reads the file, not code).
    said = {
        "CAPTURE_PROXY_MAX_INFLIGHT_PER_ROLLOUT",
        "CAPTURE_PROXY_FAIR_SHARE_INFLIGHT",
        "CAPTURE_PROXY_MAX_CONNECTIONS_PER_ADDRESS",
        "CAPTURE_PROXY_MAX_CONNECTION_RATE_PER_ADDRESS",
    }
    assert said <= set(DEPLOYMENT_ENVS[name]()), name


DEPLOYMENT_ENVS: dict[str, Callable[[], Mapping[str, object]]] = {
    "image": _image_env,
    "compose": lambda: {**_image_env(), **_services()["capture-proxy"]["environment"]},
    "kubernetes": lambda: {**_image_env(), **_k8s_env(_container("capture-proxy"))},
    "systemd": _env_file,
}


def test_the_kubernetes_caps_fit_its_memory_limit() -> None:
    # Issue 27: 10,000 live rollouts of ~1 MB each (a 60k-token prompt) is over the example's 4 GiB.
    s = _k8s_settings()
    memory = _container("capture-proxy")["resources"]["limits"]["memory"]
    assert memory.endswith("Gi")
    limit = int(memory.removesuffix("Gi")) * 2**30
    live = s.max_live_rollouts * 2**20
    decoding = s.max_decoding_bytes + 3 * s.max_body_bytes  # bodies, and what they decode into
    assert live + decoding + 512 * 2**20 <= limit


def test_no_deployment_runs_without_its_admin_token() -> None:
    # The image bakes in no token and will not start without one: keys need the control API.
    assert "CAPTURE_PROXY_ADMIN_TOKEN" not in _image_env()
    with pytest.raises(SettingsError, match="--admin-token"):
        _settings(_image_env())
    # Compose refuses to start without it in deploy/.env...
    env = _services()["capture-proxy"]["environment"]
    assert _interpolate(env["CAPTURE_PROXY_ADMIN_TOKEN"], {}) == "required"
    # ...Kubernetes reads it from the Secret...
    [token] = [e for e in _container("capture-proxy")["env"] if e["name"].endswith("ADMIN_TOKEN")]
    assert token["valueFrom"]["secretKeyRef"]["key"] == "admin-token"
    # ...and the systemd example ships none: the unit fails, naming it, until the operator adds one
    # (to the EnvironmentFile, never the command line, where `ps` would show it).
    with pytest.raises(SettingsError, match="--admin-token"):
        _settings(_env_file(filled_in=False))
    assert "token" not in _unit()["Service"]["ExecStart"][0].lower()


def test_deployments_give_the_proxy_descriptors_for_its_connection_cap() -> None:
    default_cap = Settings().max_connections
    assert connection_budget(int(_unit()["Service"]["LimitNOFILE"][0])) >= default_cap
    nofile = _services()["capture-proxy"]["ulimits"]["nofile"]
    assert nofile["soft"] == nofile["hard"]
    assert connection_budget(int(nofile["hard"])) >= default_cap


# ---- vLLM started as token-in needs ------------------------------------------------------------

#: The vLLM flag token-in needs, as the proxy's readiness problem and 503 name it.
SCALE_OUT_FLAG = re.findall(r"--[a-z-]+", SCALE_OUT_MISSING)[0]


def _bare_node_vllm_line() -> tuple[dict[str, str], list[str]]:
    """(environment assignments, arguments) of deploy/README.md's bare-node `vllm serve`
    (continuation lines joined)."""
    lines = iter((DEPLOY / "README.md").read_text().splitlines())
    for line in lines:
        words = line.split()
        if "vllm" in words and words[words.index("vllm") + 1 :][:1] == ["serve"]:
            command = line.strip()
            while command.endswith("\\"):
                command = command[:-1] + next(lines).strip()
            argv = shlex.split(command)
            at = argv.index("vllm")
            assignments = dict(a.split("=", 1) for a in argv[:at])
            return assignments, argv[at + 2 :]
    raise AssertionError("deploy/README.md has no `vllm serve` command")


def _bare_node_vllm() -> list[str]:
    return _bare_node_vllm_line()[1]


def _vllm_commands() -> dict[str, list[str]]:
    """Each deployment's `vllm serve` arguments (systemd runs the proxy only: see its example)."""
    return {
        "compose": shlex.split(_interpolate(_services()["vllm"]["command"], COMPOSE_ENV)),
        "kubernetes": [str(a) for a in _container("vllm")["args"]],
        "bare node": _bare_node_vllm(),
    }


def test_every_deployment_starts_vllm_with_the_flags_token_in_needs() -> None:
    assert SCALE_OUT_FLAG == "--enable-scale-out"
    for name, args in _vllm_commands().items():
        assert SCALE_OUT_FLAG in args, name
        assert _vllm_flag(args, "--logprobs-mode") == "processed_logprobs", name
    example = (DEPLOY / "systemd" / "capture-proxy.env.example").read_text()
    assert f"Start vLLM with {SCALE_OUT_FLAG}" in example


def _vllm_environments() -> dict[str, dict[str, str]]:
    """Each deployment's vLLM environment, as _vllm_commands."""
    return {
        "compose": {
            k: _interpolate(str(v), COMPOSE_ENV)
            for k, v in _services()["vllm"]["environment"].items()
        },
        "kubernetes": _k8s_env(_container("vllm")),
        "bare node": _bare_node_vllm_line()[0],
    }


def test_every_deployment_serves_vllms_weight_routes_only_to_the_proxy() -> None:
    # POST /admin/weights/pause|resume and PUT /admin/weight-version push to vLLM's /pause,
    # /resume and /update_weight_version, which it serves with VLLM_SERVER_DEV_MODE=1
    # (docs/fleets.md "Weight updates"): every deployment's vLLM has it...
    for name, env in _vllm_environments().items():
        assert env.get("VLLM_SERVER_DEV_MODE") == "1", name
    example = (DEPLOY / "systemd" / "capture-proxy.env.example").read_text()
    assert "start vLLM with VLLM_SERVER_DEV_MODE=1" in example
    # ...and only the proxy reaches them (vLLM's key guards /v1, not these routes): vLLM's port is
    # never published in compose, opened to nobody by the NetworkPolicy in Kubernetes (issue 27:
    # it was open to the monitoring namespace; Prometheus reads vLLM's metrics relayed by the
    # proxy), and bound to the loopback on a bare node.
    assert "ports" not in _services()["vllm"]
    assert "VLLM_API_KEY" in _secret_refs(_container("vllm"))
    (policy,) = _k8s("NetworkPolicy", "networkpolicy.yaml")
    opened = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert "vllm" not in opened
    assert _pod_ports()["vllm"] not in opened
    assert _vllm_flag(_bare_node_vllm(), "--host") == "127.0.0.1"


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_every_deployment_leaves_token_in_to_the_operator(name: str) -> None:
    # Off unless turned on (drivers may still choose per rollout): a deployment's vLLM serves the
    # routes either way, so turning it on is one variable.
    assert DEPLOYMENTS[name]().token_in == "off"


def test_token_in_is_one_variable_away_in_compose_and_systemd() -> None:
    # compose: CAPTURE_PROXY_TOKEN_IN=on in deploy/.env
    env = _services()["capture-proxy"]["environment"]
    on = {**COMPOSE_ENV, "CAPTURE_PROXY_TOKEN_IN": "on"}
    compose = {**_image_env(), **{k: _interpolate(str(v), on) for k, v in env.items()}}
    assert _settings(compose).token_in == "on"
    # systemd: the example's line, uncommented
    example = (DEPLOY / "systemd" / "capture-proxy.env.example").read_text()
    assert "# CAPTURE_PROXY_TOKEN_IN=on" in example.splitlines()
    assert _settings({**_env_file(), "CAPTURE_PROXY_TOKEN_IN": "on"}).token_in == "on"


# ---- documentation -----------------------------------------------------------------------------


def test_deploy_readme_covers_each_deployment_and_file() -> None:
    readme = (DEPLOY / "README.md").read_text()
    headings = [
        line.lstrip("#").strip().lower() for line in readme.splitlines() if line.startswith("#")
    ]
    for topic in ("compose", "kubernetes", "systemd", "bare node", "metrics", "disk", "sigterm"):
        assert any(topic in h for h in headings), topic
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.name != "README.md":
            assert path.name in readme, f"deploy/README.md does not mention {path.name}"


_STORE_WORD = re.compile(r"\b(store|dataset|s3://)", re.I)
_SEVERAL = re.compile(r"\b(shar\w*|several|many|multiple|between pods)\b", re.I)
_NEGATION = re.compile(r"\b(not|never|no|nothing|own)\b", re.I)
_OBJECT_STORE = re.compile(r"object[- ]stor(e|age)|s3://", re.I)


def _sentences(text: str) -> list[str]:
    """Sentences of Markdown prose or of YAML comments: blocks end at blank lines, headings, table
    rows and bullets; a block's lines are joined, then split at sentence ends."""
    blocks: list[list[str]] = [[]]
    for line in text.splitlines():
        bare = line.strip()
        if not bare or bare.startswith(("#", "|", "- ")):
            blocks.append([])
        blocks[-1].append(bare)
    return [
        sentence
        for block in blocks
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(block))
        if sentence.strip()
    ]


def test_deploy_docs_recommend_sharing_only_an_object_store_dataset() -> None:
    """A SQLite store has one writing proxy; several proxies may share one Parquet dataset on
    object storage (docs/storage.md, "Writers and readers today"): nothing in deploy/ suggests
    pointing several pods at any other store, and the README, the Parquet sink and
    docs/storage.md say the same rule."""
    from capture_proxy.sinks.parquet import _sink

    readme = (DEPLOY / "README.md").read_text()
    storage = (ROOT / "docs" / "storage.md").read_text()
    sink_doc = re.sub(r"\s+", " ", _sink.__doc__ or "").lower()
    assert "one writing proxy" in readme.lower()
    assert "one writing proxy per file" in storage.lower()
    assert "any number of proxies on one dataset" in storage.lower()
    assert "on object storage any number of proxies" in sink_doc
    assert "a local folder keeps one writer" in sink_doc
    texts = {"README.md": readme}
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".yml", ".service", ".example", ""):
            comments = [
                line.split("#", 1)[1] for line in path.read_text().splitlines() if "#" in line
            ]
            texts[str(path.relative_to(DEPLOY))] = "\n".join(comments)
    for name, text in texts.items():
        for sentence in _sentences(text):
            if _STORE_WORD.search(sentence) and _SEVERAL.search(sentence):
                assert _NEGATION.search(sentence) or _OBJECT_STORE.search(sentence), (
                    f"{name}: {sentence!r}"
                )


def test_k8s_replicas_share_only_an_object_store_dataset() -> None:
    # A StatefulSet's replicas share one pod template: a store URL is one store for every replica.
    # That is the fleet's point on object storage; any other store must be on a per-pod volume.
    s = _k8s_settings()
    if _on_object_storage(s.store):
        return
    claims = {t["metadata"]["name"] for t in _workload()["spec"].get("volumeClaimTemplates", [])}
    proxy = _container("capture-proxy")
    (mount,) = [m for m in proxy["volumeMounts"] if Path(m["mountPath"]) == _store_dir(s)]
    assert mount["name"] in claims  # per pod, not a volume every replica mounts
