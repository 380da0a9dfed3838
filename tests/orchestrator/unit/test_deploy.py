"""deploy/ checked against the code: images, entrypoints, resource names, ports and metric names."""

import collections
import json
import os
import re
import shlex
import tomllib

import pytest
import yaml

from tests.helpers.paths import ROOT

DEPLOY = os.path.join(ROOT, "deploy")
MANIFESTS = [
    "raycluster-gpu.yaml",
    "rayjob-gpu.yaml",
    "raycluster-gb200-nvl72.yaml",
    "raycluster-tpu.yaml",
    "rayjob-tpu.yaml",
    "rayjob-tpu-multislice.yaml",
]


def load(name):
    with open(os.path.join(DEPLOY, "kuberay", name)) as f:
        return yaml.safe_load(f)


def _family(name):
    return "tpu" if "tpu" in name else "gpu"


def cluster_spec(doc):
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def containers(spec):
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def version():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["version"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifests_use_the_image_the_dockerfile_builds_with_token_auth(name):
    doc = load(name)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in ("RayCluster", "RayJob")
    spec = cluster_spec(doc)
    family = _family(name)
    dockerfile = open(os.path.join(DEPLOY, "Dockerfile")).read()
    assert f"-t remesh/remesh:{version()}-{family}" in dockerfile
    import ray

    assert spec["rayVersion"] == ray.__version__  # the image installs the Ray remesh pins; the operator must agree
    for c in containers(spec):
        assert c["image"] == f"remesh/remesh:{version()}-{family}", c["image"]
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "remesh-ray-token"


@pytest.mark.parametrize("name", MANIFESTS)
def test_worker_pods_are_remesh_hosts_with_their_accelerators(name):
    from orchestrator.hosts.group import HOST_RESOURCE

    spec = cluster_spec(load(name))
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no host actors on the head
    for group in spec["workerGroupSpecs"]:
        resources = json.loads(json.loads(group["rayStartParams"]["resources"]))
        assert resources[HOST_RESOURCE] == 1
        (c,) = group["template"]["spec"]["containers"]
        limits = c["resources"]["limits"]
        if _family(name) == "gpu":
            assert limits["nvidia.com/gpu"] == int(group["rayStartParams"]["num-gpus"]) in (4, 8)
        else:
            assert limits["google.com/tpu"] == resources["TPU"] == 4
            assert group["numOfHosts"] > 1  # a multi-host slice
            selector = group["template"]["spec"]["nodeSelector"]
            chips = 1
            for n in selector["cloud.google.com/gke-tpu-topology"].split("x"):
                chips *= int(n)
            assert chips == group["numOfHosts"] * limits["google.com/tpu"]


@pytest.mark.parametrize("name", ["rayjob-gpu.yaml", "rayjob-tpu.yaml", "rayjob-tpu-multislice.yaml"])
def test_rayjob_entrypoints_are_remesh_commands_whose_job_files_fit_the_pods(name):
    from orchestrator.cli.main import build_parser
    from orchestrator.control.controller import ControllerConfig
    from orchestrator.job.jobfile import load_job
    from partitioner import profile

    doc = load(name)
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[0] == "remesh"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "run" and args.address == "auto"
    dockerfile = open(os.path.join(DEPLOY, "Dockerfile")).read()
    assert "WORKDIR /app" in dockerfile and "COPY examples ./examples" in dockerfile
    job = load_job(os.path.join(ROOT, args.job))  # /app in the image is the repository root
    groups = cluster_spec(doc)["workerGroupSpecs"]
    for group in groups:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        accelerators = limits.get("nvidia.com/gpu") or limits.get("google.com/tpu")
        assert job.hosts.devices_per_host == accelerators
        mounts = {m["mountPath"] for m in group["template"]["spec"]["containers"][0]["volumeMounts"]}
        assert any(job.checkpoint.dir.startswith(m + "/") for m in mounts), (job.checkpoint.dir, mounts)
        if job.hosts.hosts_per_slice:  # the job's slices are the cluster's
            assert group.get("numOfHosts", 1) == job.hosts.hosts_per_slice, group["groupName"]
    assert profile(job.hardware).name.startswith("h100" if _family(name) == "gpu" else "tpu")
    most = sum(g.get("maxReplicas", g["replicas"]) * g.get("numOfHosts", 1) for g in groups)
    assert job.hosts.min <= job.hosts.max <= most
    # A preemption of the head (where the job's controller runs) gives notice through --stop-file,
    # with time to commit the step reached.
    head = cluster_spec(doc)["headGroupSpec"]["template"]["spec"]
    hook = head["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert args.stop_file and f"touch {args.stop_file}" in hook[-1]
    assert head["terminationGracePeriodSeconds"] > ControllerConfig().stop_grace_s


def test_prometheus_scrapes_the_metrics_port_and_restores_remesh_names():
    with open(os.path.join(DEPLOY, "prometheus", "prometheus.yml")) as f:
        config = yaml.safe_load(f)
    ports = {
        g["rayStartParams"]["metrics-export-port"]
        for n in MANIFESTS
        for g in [cluster_spec(load(n))["headGroupSpec"], *cluster_spec(load(n))["workerGroupSpecs"]]
    }
    assert ports == {"8080"}
    for n in MANIFESTS:
        for c in containers(cluster_spec(load(n))):
            assert {"containerPort": 8080, "name": "metrics"} in c["ports"]
    from orchestrator.metrics import METRICS

    for job in config["scrape_configs"]:
        (rule,) = job["metric_relabel_configs"]
        assert rule["target_label"] == "__name__"
        for name in METRICS:  # what Ray exports -> what Grafana queries
            exported = f"ray_{name}"
            m = re.fullmatch(rule["regex"], exported)
            assert m and m.expand(rule["replacement"].replace("$1", r"\1")) == name
        assert re.fullmatch(rule["regex"], "ray_node_cpu_utilization") is None  # Ray's own are left alone


def test_grafana_dashboard_shows_the_built_in_pages_figures_with_metric_names_from_the_code():
    from orchestrator.metrics import METRICS

    with open(os.path.join(DEPLOY, "grafana", "remesh-dashboard.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"]]
    used = {m for e in exprs for m in re.findall(r"\bremesh_\w+", e)}
    assert used <= set(METRICS), used - set(METRICS)
    # The dashboard page's figures: tokens/s, MFU, goodput and its badput, loss, per-host step
    # times, resizes (devices) and host losses.
    assert {
        "remesh_tokens_per_second",
        "remesh_mfu",
        "remesh_goodput_ratio",
        "remesh_badput_seconds",
        "remesh_loss",
        "remesh_step_seconds",
        "remesh_wait_seconds",
        "remesh_devices",
        "remesh_host_losses_total",
    } <= used
    step_panel = next(p for p in dashboard["panels"] if "remesh_step_seconds" in p["targets"][0]["expr"])
    assert "{{host}}" in step_panel["targets"][0]["legendFormat"]  # per host, so a straggler stands out
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def kueue(name):
    with open(os.path.join(DEPLOY, "kueue", name)) as f:
        return {doc["kind"]: doc for doc in yaml.safe_load_all(f)}


def requests_of(spec, replicas_key="minReplicas"):
    """What a Ray cluster asks of Kubernetes at its smallest (the head, and each worker group at
    its minimum), per resource, in the units Kueue's quota is written in (CPUs, GiB, GPUs)."""

    def amount(value):
        value = str(value)
        return float(value[:-2]) if value.endswith("Gi") else float(value)

    total = {}
    groups = [(spec["headGroupSpec"], 1)] + [(g, g[replicas_key]) for g in spec["workerGroupSpecs"]]
    for group, n in groups:
        for c in group["template"]["spec"]["containers"]:
            for resource, value in c["resources"]["requests"].items():
                total[resource] = total.get(resource, 0.0) + n * amount(value)
    return total


def test_kueue_admits_the_shared_cluster_and_a_suspended_job_within_its_quota():
    queues = kueue("queues.yaml")
    cluster_queue, local_queue = queues["ClusterQueue"], queues["LocalQueue"]
    assert local_queue["spec"]["clusterQueue"] == cluster_queue["metadata"]["name"]
    (group,) = cluster_queue["spec"]["resourceGroups"]
    (flavor,) = group["flavors"]
    assert flavor["name"] == queues["ResourceFlavor"]["metadata"]["name"]
    quota = {r["name"]: float(str(r["nominalQuota"]).removesuffix("Gi")) for r in flavor["resources"]}
    shared = kueue("raycluster-fleet-gpu.yaml")["RayCluster"]
    job = kueue("rayjob-kueue-gpu.yaml")["RayJob"]
    for doc, spec in ((shared, shared["spec"]), (job, job["spec"]["rayClusterSpec"])):
        assert doc["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == local_queue["metadata"]["name"]
        asked = requests_of(spec)
        assert set(asked) <= set(group["coveredResources"]), asked  # Kueue refuses what it does not cover
        assert all(asked[r] <= quota[r] for r in asked), (asked, quota)  # admissible at all
    assert job["spec"]["suspend"] is True  # created suspended: Kueue admits it by resuming it


def test_the_shared_cluster_starts_the_fleet_scheduler_with_its_fleet_file():
    from orchestrator.cli.main import build_parser
    from orchestrator.fleet.config import parse_fleet
    from orchestrator.job.jobfile import load_job

    docs = kueue("raycluster-fleet-gpu.yaml")
    fleet = parse_fleet(tomllib.loads(docs["ConfigMap"]["data"]["fleet.toml"]))
    head = docs["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]
    command = head["containers"][0]["lifecycle"]["postStart"]["exec"]["command"][-1]
    start = re.search(r"(remesh fleet start [^&;]*?)\s*&&", command)[1]
    args = build_parser().parse_args(shlex.split(start)[1:])
    assert (args.command, args.action, args.address) == ("fleet", "start", "auto")
    mount = next(m for m in head["containers"][0]["volumeMounts"] if args.config.startswith(m["mountPath"] + "/"))
    volume = next(v for v in head["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert os.path.basename(args.config) in docs["ConfigMap"]["data"]
    # The example jobs name queues the fleet has, with minimums its quotas allow.
    for path in ("examples/gpt/job.toml", "examples/gpt/job-gpu.toml"):
        job = load_job(os.path.join(ROOT, path))
        assert job.queue in fleet.quotas
        limit = fleet.quotas[job.queue].hosts
        assert limit is None or job.hosts.min <= limit


def _pods(spec):
    """The worker pods a Ray cluster spec makes at its size, as `ray.nodes()` would list their
    Ray nodes: resources and labels from each group's rayStartParams, with the container's
    environment expanded as the `bash -lc` that KubeRay runs `ray start` in expands it (a
    `spec.nodeName` field reference: a distinct node per pod)."""
    from ray._private.label_utils import parse_node_labels_string, validate_node_label_syntax, validate_node_labels

    nodes = []
    for group in spec["workerGroupSpecs"]:
        params = group["rayStartParams"]
        (c,) = group["template"]["spec"]["containers"]
        for replica in range(group["replicas"]):
            for host in range(group.get("numOfHosts", 1)):
                pod = f"{group['groupName']}-{replica}-{host}"
                env = {e["name"]: e.get("value") or f"node-of-{pod}" for e in c["env"]}
                said = re.sub(r"\$\{(\w+)\}", lambda m, env=env: env[m[1]], params.get("labels", ""))
                labels = parse_node_labels_string(said)
                validate_node_labels(labels)  # what `ray start` refuses (ray.io/ keys are Ray's own)
                validate_node_label_syntax(labels)
                resources = json.loads(json.loads(params["resources"]))
                nodes.append({"NodeID": pod, "Alive": True, "Resources": resources, "Labels": labels})
    return nodes


@pytest.mark.parametrize(
    "name, hardware, slices, hosts",
    [
        ("raycluster-gpu.yaml", "h100", 4, 1),  # each 8-GPU host its own NVLink domain
        ("rayjob-gpu.yaml", "h100", 4, 1),
        ("raycluster-gb200-nvl72.yaml", "gb200-nvl72", 2, 18),  # a rack of 18 trays a domain
        ("rayjob-tpu-multislice.yaml", "tpu-v5p", 2, 2),
    ],
)
def test_hosts_say_their_slices_as_remesh_reads_them(name, hardware, slices, hosts):
    """Each manifest's hosts, as Ray would list them, read by remesh's own `host_slices`: the
    slices the manifest means, and on TPU a host lost takes its slice out of the usable hosts."""
    from orchestrator.hosts.slices import host_slices
    from orchestrator.job.slices import SliceLayout

    nodes = _pods(cluster_spec(load(name)))
    said = host_slices(nodes)
    sizes = sorted(collections.Counter(said.values()).values())
    assert sizes == [hosts] * slices, sizes
    layout = SliceLayout.of(hardware, hosts)
    assert layout.usable(said) == sorted(said, key=lambda n: (said[n], n))  # whole slices, slice-major
    nodes[0]["Alive"] = False
    left = layout.usable(host_slices(nodes))
    lost = hosts if layout.fails_by == "slice" else 1
    assert len(left) == len(nodes) - lost
