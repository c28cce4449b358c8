"""deploy/: Kubernetes manifests, compose files and the Dockerfile, checked offline.

- Every Kubernetes object is validated against the official schemas of one Kubernetes release
  (``kubernetes-validate``, strict: unknown fields are errors). ServiceMonitor is a Prometheus
  Operator CRD with no schema there: it is checked structurally (selector and port match a
  Service of ours).
- The engines' args in the manifests and compose.yaml equal ``render_command`` of the policy
  they run under, so the gateway's limits and the engines' cannot drift apart.
- Compose files parse with ``compose-spec`` (the compose schema) and reference only services,
  networks, volumes, configs and files that exist.
- The Dockerfile's final stage runs as a non-root user and installs no compiler.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from compose_spec import PyCompose
from dockerfile_parse import DockerfileParser

from engine_pool.launch import render_command
from gateway.config_check import load_settings
from gateway.settings import Settings, parse_settings
from gateway.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.33.0"
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
COMPILERS = re.compile(r"\b(gcc|g\+\+|clang|cc|make|build-essential|python3?-dev|rustc|cargo)\b")

Doc = dict[str, Any]


def k8s_docs(folder: Path = K8S) -> Iterator[tuple[Path, Doc]]:
    for path in sorted(folder.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def objects(kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for _, d in k8s_docs() if d["kind"] == kind}


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def configmap_policy() -> tuple[str, Settings]:
    text = objects("ConfigMap")["shapegate-policy"]["data"]["policy.yaml"]
    return text, parse_settings(yaml.safe_load(text), environ={})


def test_every_manifest_matches_the_kubernetes_schema() -> None:
    checked = []
    for path, doc in k8s_docs():
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{path.name} {doc['kind']} {doc['metadata']['name']}: {where}: {exc}")
        checked.append(doc["kind"])
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret"} <= set(checked)
    assert {"PodDisruptionBudget", "Namespace"} <= set(checked)


def test_the_schema_check_catches_a_misspelt_field() -> None:
    gateway = copy.deepcopy(objects("Deployment")["shapegate-gateway"])
    container = pod_spec(gateway)["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(gateway, K8S_VERSION, strict=True)


def test_service_monitors_select_our_services_by_port_name() -> None:
    services = objects("Service")
    monitors = [d for _, d in k8s_docs() if (d["apiVersion"], d["kind"]) in CRDS]
    assert {m["metadata"]["name"] for m in monitors} == {"shapegate-gateway", "shapegate-engines"}
    for monitor in monitors:
        spec = monitor["spec"]
        assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
        wanted = spec["selector"]["matchLabels"].items()
        selected = [s for s in services.values() if wanted <= s["metadata"]["labels"].items()]
        assert selected, monitor["metadata"]["name"]
        for endpoint in spec["endpoints"]:
            assert endpoint["path"] == "/metrics"
            assert re.fullmatch(r"[0-9]+[smh]", endpoint["interval"])
            for service in selected:
                assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    for _, doc in k8s_docs():
        assert doc["metadata"].get("namespace", "shapegate") == kustomization["namespace"]


def test_services_and_disruption_budget_select_running_pods() -> None:
    workloads = {**objects("Deployment"), **objects("StatefulSet")}
    for name, service in objects("Service").items():
        wanted = service["spec"]["selector"].items()
        pods = [
            w
            for w in workloads.values()
            if wanted <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(pods) == 1, name
        ports = {p["name"] for c in pod_spec(pods[0])["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports, name
    gateway = workloads["shapegate-gateway"]
    budget = objects("PodDisruptionBudget")["shapegate-gateway"]
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert 0 < budget["spec"]["minAvailable"] < gateway["spec"]["replicas"]


def test_secret_references_name_existing_keys() -> None:
    secrets = {n: set(s["stringData"]) for n, s in objects("Secret").items()}
    for _, doc in k8s_docs():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in pod_spec(doc)["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]], env["name"]


def test_the_configmap_policy_is_the_production_example_and_passes_check_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    text, settings = configmap_policy()
    assert text == (ROOT / "configs" / "production-two-lanes.yaml").read_text()
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    # The engine key comes from the Secret in the pod; without it serve would not start.
    monkeypatch.delenv("ENGINE_API_KEY", raising=False)
    assert main(["check-config", str(path)]) == 2
    assert "api_key_env: environment variable ENGINE_API_KEY is not set" in capsys.readouterr().err
    monkeypatch.setenv("ENGINE_API_KEY", "from-the-secret")
    assert main(["check-config", str(path)]) == 0
    captured = capsys.readouterr()
    assert "heavy: 32768 <= prompt tokens < 1040384" in captured.out
    assert captured.err == ""  # no policy warning either
    assert {lane.name for lane in settings.lanes} == {"fast", "heavy"}


def test_gateway_deployment_runs_three_replicas_on_redis() -> None:
    gateway = objects("Deployment")["shapegate-gateway"]
    assert gateway["spec"]["replicas"] == 3
    (container,) = pod_spec(gateway)["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["SHAPEGATE_STATE__BACKEND"] == "redis"
    text, _ = configmap_policy()
    settings = parse_settings(yaml.safe_load(text), environ=env)
    assert settings.state.backend == "redis"
    assert settings.state.redis_url.startswith("redis://redis:6379")
    assert settings.state.replicas == gateway["spec"]["replicas"]
    assert "redis" in objects("Service")
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(gateway)["volumes"]}
    assert volumes["policy"]["configMap"]["name"] == "shapegate-policy"
    assert container["args"] == ["serve", "--config", f"{mounts['policy']}/policy.yaml"]
    assert pod_spec(gateway)["securityContext"]["runAsNonRoot"] is True
    # The rollout drains within the grace period.
    assert pod_spec(gateway)["terminationGracePeriodSeconds"] > settings.server.drain_timeout_s


def test_engine_manifests_run_exactly_the_rendered_commands() -> None:
    _, settings = configmap_policy()
    engines = objects("StatefulSet")
    assert set(engines) == {f"engine-{c.name}" for c in settings.clusters}
    for cluster in settings.clusters:
        engine = cluster.engine
        assert engine is not None
        workload = engines[f"engine-{cluster.name}"]
        (container,) = pod_spec(workload)["containers"]
        command = render_command(settings, cluster.name)
        assert container["command"] + container["args"] == command.args("k8s")
        env = {e["name"]: e.get("value") for e in container["env"]}
        for name, value in command.environment("k8s").items():
            assert env[name] == value
            # $(VAR) expands only from variables defined earlier in the list.
            referenced = value[2:-1]
            names = [e["name"] for e in container["env"]]
            assert names.index(referenced) < names.index(name)
        assert container["image"] == f"vllm/vllm-openai:v{engine.version}"
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert int(gpus) == engine.tensor_parallel_size
        assert container["ports"][0]["containerPort"] == engine.port
        # The policy's endpoints are exactly the pods this StatefulSet creates.
        service = workload["spec"]["serviceName"]
        pods = {
            f"http://{workload['metadata']['name']}-{i}.{service}:{engine.port}"
            for i in range(workload["spec"]["replicas"])
        }
        assert set(cluster.endpoints) == pods
        assert objects("Service")[service]["spec"]["clusterIP"] == "None"


def compose(name: str) -> Doc:
    path = ROOT / "deploy" / name
    text = path.read_text()
    PyCompose.from_yaml(text).validate()  # the compose schema; raises on unknown keys
    doc: Doc = yaml.safe_load(text)
    return doc


def bind_source(volume: str) -> str | None:
    source = volume.split(":", maxsplit=1)[0]
    return source if source.startswith((".", "/", "~")) else None


@pytest.mark.parametrize("name", ["compose.yaml", "compose.sim.yaml"])
def test_compose_files_reference_only_what_exists(name: str) -> None:
    doc = compose(name)
    services = doc["services"]
    assert {"gateway", "redis", "prometheus", "grafana", "engine-fast", "engine-heavy"} <= set(
        services
    )
    for service_name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{service_name} depends on {dependency}"
        for network in service.get("networks", []):
            assert network in doc.get("networks", {}), f"{service_name}: network {network}"
        for config in service.get("configs", []):
            assert config["source"] in doc.get("configs", {})
        for volume in service.get("volumes", []):
            source = bind_source(volume)
            if source is None:
                assert volume.split(":")[0] in doc.get("volumes", {}), volume
                continue
            assert (ROOT / "deploy" / source).exists(), f"{service_name}: {source}"
        assert "healthcheck" in service, service_name
    gateway = services["gateway"]
    assert gateway["build"]["context"] == ".."
    assert (ROOT / "deploy" / gateway["build"]["context"] / gateway["build"]["dockerfile"]).exists()
    assert gateway["environment"]["SHAPEGATE_STATE__BACKEND"] == "redis"


@pytest.mark.parametrize("name", ["compose.yaml", "compose.sim.yaml"])
def test_compose_prometheus_scrapes_the_services_with_the_shipped_rules(name: str) -> None:
    doc = compose(name)
    prometheus = doc["services"]["prometheus"]
    (config,) = prometheus["configs"]
    assert f"--config.file={config['target']}" in prometheus["command"]
    scrape = yaml.safe_load(doc["configs"][config["source"]]["content"])
    # The same jobs as deploy/prometheus/prometheus.yml, pointed at the compose services.
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert set(jobs) == {job["job_name"] for job in shipped["scrape_configs"]}
    mounted = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"]}
    for rules in scrape["rule_files"]:
        assert (ROOT / "deploy" / mounted[rules]).is_file(), rules
    settings = compose_policy(doc)
    engines = {url.removeprefix("http://") for c in settings.clusters for url in c.endpoints}
    targets = {t for job in jobs.values() for g in job["static_configs"] for t in g["targets"]}
    assert targets == {f"gateway:{settings.server.port}", *engines}


def compose_policy(doc: Doc) -> Settings:
    (volume,) = doc["services"]["gateway"]["volumes"]
    source = bind_source(volume)
    assert source is not None and volume.split(":")[1] == "/etc/shapegate/policy.yaml"
    settings = load_settings(ROOT / "deploy" / source, environ={})
    # Every engine endpoint is a compose service on the engine's port.
    for cluster in settings.clusters:
        for url in cluster.endpoints:
            host = url.removeprefix("http://").split(":")[0]
            assert host in doc["services"], url
    return settings


def test_compose_engines_run_exactly_the_rendered_commands() -> None:
    doc = compose("compose.yaml")
    settings = compose_policy(doc)
    gpus_taken: list[str] = []
    for cluster in settings.clusters:
        engine = cluster.engine
        assert engine is not None
        service = doc["services"][f"engine-{cluster.name}"]
        command = render_command(settings, cluster.name)
        assert service["entrypoint"] + service["command"] == command.args("compose")
        assert service["image"] == f"vllm/vllm-openai:v{engine.version}"
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert "gpu" in device["capabilities"]
        assert len(device["device_ids"]) == engine.tensor_parallel_size
        gpus_taken += device["device_ids"]
        assert command.env == ()
    assert len(gpus_taken) == len(set(gpus_taken)), "two engines reserve the same GPU"


def test_compose_sim_engines_are_simulators_of_the_same_model() -> None:
    doc = compose("compose.sim.yaml")
    settings = compose_policy(doc)
    for cluster in settings.clusters:
        service = doc["services"][f"engine-{cluster.name}"]
        args = service["command"]
        assert args[0] == "sim"
        assert args[args.index("--port") + 1] == "8000"
        profile = args[args.index("--profile") + 1]
        # The image copies configs/ to /app/configs.
        local = ROOT / profile.removeprefix("/app/")
        served = yaml.safe_load(local.read_text())
        names = {served["model"], *served.get("aliases", [])}
        model = settings.model(cluster.models[0])
        assert model is not None and {model.name, *model.aliases} <= names
        assert "deploy" not in service  # no GPU reservation: runs anywhere


def dockerfile_stages() -> list[list[Doc]]:
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    stages: list[list[Doc]] = []
    for instruction in parser.structure:
        if instruction["instruction"] == "FROM":
            stages.append([])
        if stages and instruction["instruction"] != "COMMENT":
            stages[-1].append(instruction)
    return stages


def test_dockerfile_final_stage_is_slim_non_root_and_has_no_compiler() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2, "multi-stage: the build stage stays out of the image"
    final = stages[-1]
    args = DockerfileParser(path=str(ROOT / "Dockerfile")).structure
    base = {
        m.group(1): m.group(2)
        for i in args
        if i["instruction"] == "ARG" and (m := re.match(r"(\w+)=(\S+)", i["value"]))
    }
    image = re.sub(r"\$\{(\w+)\}", lambda m: base[m.group(1)], final[0]["value"].split()[0])
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", image), image
    users = [i["value"] for i in final if i["instruction"] == "USER"]
    assert users, "the final stage must switch user"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    for instruction in final:
        if instruction["instruction"] == "RUN":
            assert not COMPILERS.search(instruction["value"]), instruction["value"]
        if instruction["instruction"] == "COPY" and "--from" not in instruction["value"]:
            # Only the virtualenv comes from the build stage; no source tree, no build files.
            assert not instruction["value"].startswith(("gateway", "engine_pool", "."))
    copies = [i["value"] for i in final if i["instruction"] == "COPY" and "--from" in i["value"]]
    assert copies == ["--from=build /opt/shapegate /opt/shapegate"]
    entry = [i["value"] for i in final if i["instruction"] == "ENTRYPOINT"]
    assert entry == ['["shapegate"]']


def test_dockerignore_lets_in_exactly_what_the_dockerfile_copies() -> None:
    rules = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert rules[0] == "*", "an allow-list: secrets, .git and .venv stay out of the context"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    for stage in dockerfile_stages():
        for instruction in stage:
            if instruction["instruction"] != "COPY" or "--from" in instruction["value"]:
                continue
            *sources, _ = instruction["value"].split()
            for source in sources:
                assert source.split("/")[0] in allowed, source
                assert (ROOT / source).exists(), source
