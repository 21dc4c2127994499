"""`kvps k8s render`: Kubernetes manifests for a kvps job, in the roles Kubeflow's MXJob uses.

    kvps k8s render -n 4 -s 2 --image registry.example/train:1 -- python train.py > job.yaml
    kubectl apply -f job.yaml

What it writes (NAME is --name, default kvps-job):
    Secret       NAME-keys        the job's CurveZMQ keys, one secret file per node (H.json, S0.json, W1.json),
                                  mounted read-only (mode 0400) at /etc/kvps/keys; --keys-placeholder
                                  leaves it empty, for keys made with `kvps keys new` and kubectl
    Pod          NAME-scheduler   `kvps scheduler -n W -s S` on --port; restartPolicy Never
    Service      NAME-scheduler   the scheduler's stable DNS name, which every node gets as KVPS_SCHEDULER
    StatefulSet  NAME-server      S servers; KVPS_RANK is the pod's ordinal (apps.kubernetes.io/pod-index)
    Service      NAME-server      headless (clusterIP None): stable per-pod names for the servers
    Job          NAME-worker      W workers as an Indexed Job; KVPS_RANK is the completion index (with
                                  --elastic --restart-workers N, a failed worker's container starts again
                                  in its pod, at most N times: it rejoins the job as that rank)

Every container gets KVPS_ROLE, KVPS_SCHEDULER, KVPS_NUM_WORKERS, KVPS_NUM_SERVERS, KVPS_RANK and
KVPS_HOST (its pod IP, through the downward API), KVPS_SECRET_FILE (its own file in the Secret,
named with $(KVPS_RANK), which Kubernetes expands), the same values as MXNet's DMLC_* variables (so
a script written for MXNet's launcher reads them too), and the --env variables. Workers request
--cpu and --memory (and a --gpus limit of nvidia.com/gpu), servers --server-cpu and --server-memory.
A job with -s 0 (all-reduce) has no servers. tests/unit/test_k8s.py validates the output against
the Kubernetes OpenAPI schemas (kubernetes-validate) and runs a real job from the rendered specs on
this machine; docs/launch.md says what has and has not been run on a cluster.
"""
import re

from kvps.errors import ConfigError

DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 40              # room for "-scheduler", "-server-N" and a Job's pod suffix within 63
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SERVER_PORT = 9100         # what servers bind (KVPS_PORT), declared as their containerPort
KEYS_DIR = "/etc/kvps/keys"


class Resources:
    """Requests (and the GPU limit) of workers and servers, in Kubernetes quantities."""

    def __init__(self, cpu="1", memory="2Gi", gpus=0, server_cpu="1", server_memory="2Gi"):
        for what, value in (("--cpu", cpu), ("--memory", memory), ("--server-cpu", server_cpu),
                            ("--server-memory", server_memory)):
            if not re.fullmatch(r"\d+(\.\d+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?", str(value)):
                raise ConfigError(f"{what} {value!r} is not a Kubernetes quantity such as 500m, 2 or 4Gi")
        if gpus < 0:
            raise ConfigError(f"--gpus {gpus} must not be negative")
        self.cpu, self.memory, self.gpus = str(cpu), str(memory), int(gpus)
        self.server_cpu, self.server_memory = str(server_cpu), str(server_memory)

    def worker(self):
        spec = {"requests": {"cpu": self.cpu, "memory": self.memory}}
        if self.gpus:
            spec["limits"] = {"nvidia.com/gpu": self.gpus}
        return spec

    def server(self):
        return {"requests": {"cpu": self.server_cpu, "memory": self.server_memory}}


def _field(path):
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def secret_data(num_workers, num_servers):
    """{NAME.json: base64 of node NAME's secret file} for every node, fresh keys (kvps/wire/keys.py)."""
    import base64
    from kvps.wire.keys import job_names, make_job_keys
    data = {}
    for node, path in make_job_keys(None, job_names(num_workers, num_servers)).items():
        with open(path, "rb") as f:
            data[f"{node}.json"] = base64.b64encode(f.read()).decode()
    return data


def render(num_workers, num_servers, image, command, name="kvps-job", namespace=None, port=9091, env=None,
           resources=None, python="python", keys=None, elastic=False, restart_workers=0):
    """The job's manifests, as a list of dicts in apply order. keys: the Secret's data (None: none,
    a placeholder; secret_data() makes them). elastic: KVPS_ELASTIC=1 on every node, and workers whose
    container Kubernetes starts again in place (same pod, same rank) when it fails, at most
    restart_workers times over the Job (its backoffLimit), as `kvps launch --elastic
    --restart-workers N` does. Raises ConfigError naming a bad value."""
    if num_workers < 1 or num_servers < 0:
        raise ConfigError(f"a job needs at least one worker and no negative number of servers "
                          f"(got -n {num_workers} -s {num_servers})")
    if not command:
        raise ConfigError("no worker command given: kvps k8s render -n W -s S --image IMAGE -- python train.py")
    if not image or any(c.isspace() for c in image):
        raise ConfigError(f"--image {image!r} is not an image reference")
    if not DNS_LABEL.match(name or "") or len(name) > MAX_NAME:
        raise ConfigError(f"--name {name!r} must be a DNS label (lowercase letters, digits and '-', starting "
                          f"with a letter) of at most {MAX_NAME} characters")
    if namespace is not None and not DNS_LABEL.match(namespace):
        raise ConfigError(f"--namespace {namespace!r} is not a DNS label")
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a port number")
    if restart_workers < 0 or (restart_workers and not (elastic and num_servers)):
        raise ConfigError(f"--restart-workers {restart_workers}: give a number >= 0, and more than 0 only with "
                          f"--elastic and -s 1 or more (elastic membership is the parameter server's)")
    env = dict(env or {})
    if elastic:
        env["KVPS_ELASTIC"] = "1"
    bad = [k for k in env if not ENV_NAME.match(k)]
    if bad:
        raise ConfigError(f"--env names {bad!r} are not environment variable names")
    resources = resources or Resources()
    scheduler = f"{name}-scheduler"

    def meta(obj_name, role=None):
        m = {"name": obj_name, "labels": labels(role)}
        if namespace:
            m["namespace"] = namespace
        return m

    def labels(role=None):
        out = {"app.kubernetes.io/name": "kvps", "app.kubernetes.io/instance": name}
        if role:
            out["kvps.io/role"] = role
        return out

    def container(role, argv, rank_field=None, ports=(), res=None):
        variables = {"KVPS_ROLE": role, "KVPS_SCHEDULER": f"{scheduler}:{port}",
                     "KVPS_NUM_WORKERS": str(num_workers), "KVPS_NUM_SERVERS": str(num_servers),
                     "DMLC_ROLE": role, "DMLC_PS_ROOT_URI": scheduler, "DMLC_PS_ROOT_PORT": str(port),
                     "DMLC_NUM_WORKER": str(num_workers), "DMLC_NUM_SERVER": str(num_servers),
                     "PYTHONUNBUFFERED": "1"}
        if role == "server":
            variables["KVPS_PORT"] = str(SERVER_PORT)
        variables.update(env)
        entries = [{"name": k, "value": v} for k, v in variables.items()]
        entries.append({"name": "KVPS_HOST", **_field("status.podIP")})
        if rank_field:
            entries.append({"name": "KVPS_RANK", **_field(rank_field)})
        node = "H" if role == "scheduler" else role[0].upper() + "$(KVPS_RANK)"    # expanded by Kubernetes
        entries.append({"name": "KVPS_SECRET_FILE", "value": f"{KEYS_DIR}/{node}.json"})
        spec = {"name": role, "image": image, "command": list(argv), "env": entries,
                "volumeMounts": [{"name": "keys", "mountPath": KEYS_DIR, "readOnly": True}]}
        if ports:
            spec["ports"] = [{"name": n, "containerPort": p} for n, p in ports]
        if res:
            spec["resources"] = res
        return spec

    def pod_spec(c, restart):
        return {"restartPolicy": restart, "containers": [c],
                "volumes": [{"name": "keys", "secret": {"secretName": f"{name}-keys", "defaultMode": 0o400}}]}

    docs = [{
        "apiVersion": "v1", "kind": "Secret",
        "metadata": dict(meta(f"{name}-keys"), annotations={
            "kvps.io/note": "the job's CurveZMQ keys, one file per node, mounted read-only at " + KEYS_DIR +
                            ("" if keys else "; empty placeholder: fill it with the files of "
                                             f"`kvps keys new DIR -n {num_workers} -s {num_servers}`")}),
        "type": "Opaque", "data": dict(keys or {}),
    }, {
        "apiVersion": "v1", "kind": "Pod", "metadata": meta(scheduler, "scheduler"),
        "spec": pod_spec(container("scheduler", [python, "-m", "kvps.cli", "scheduler", "--host", "0.0.0.0",
                                                 "--port", str(port), "-n", str(num_workers), "-s", str(num_servers)],
                                   ports=[("scheduler", port)], res={"requests": {"cpu": "500m", "memory": "512Mi"}}),
                         "Never"),
    }, {
        "apiVersion": "v1", "kind": "Service", "metadata": meta(scheduler, "scheduler"),
        "spec": {"selector": labels("scheduler"), "ports": [{"name": "scheduler", "port": port, "targetPort": port}]},
    }]
    if num_servers:
        docs += [{
            "apiVersion": "v1", "kind": "Service", "metadata": meta(f"{name}-server", "server"),
            "spec": {"clusterIP": "None", "selector": labels("server"),
                     "ports": [{"name": "server", "port": SERVER_PORT, "targetPort": SERVER_PORT}]},
        }, {
            "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(f"{name}-server", "server"),
            "spec": {
                "serviceName": f"{name}-server", "replicas": num_servers, "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": labels("server")},
                "template": {"metadata": {"labels": labels("server")},
                             "spec": pod_spec(container("server", [python, "-m", "kvps.cli", "server"],
                                                        "metadata.labels['apps.kubernetes.io/pod-index']",
                                                        [("server", SERVER_PORT)], resources.server()), "Always")},
            },
        }]
    docs.append({
        "apiVersion": "batch/v1", "kind": "Job", "metadata": meta(f"{name}-worker", "worker"),
        "spec": {
            "completionMode": "Indexed", "completions": num_workers, "parallelism": num_workers,
            "backoffLimit": restart_workers,
            "template": {"metadata": {"labels": labels("worker")},
                         "spec": pod_spec(container("worker", command,
                                                    "metadata.annotations['batch.kubernetes.io/job-completion-index']",
                                                    res=resources.worker()), "OnFailure" if restart_workers else "Never")},
        },
    })
    return docs


def dump(manifests):
    """The manifests as one YAML stream (needs PyYAML: pip install 'kvps[k8s]')."""
    try:
        import yaml
    except ImportError:
        raise ConfigError("kvps k8s render writes YAML with PyYAML, which is not installed: "
                          "pip install 'kvps[k8s]'") from None
    return yaml.safe_dump_all(manifests, sort_keys=False, default_flow_style=False)
