"""`kvps k8s render`: the manifests validate against the Kubernetes OpenAPI schemas (offline, with
kubernetes-validate's bundled schemas) and wire every role the way the job needs.
tests/cluster/test_launch.py runs a real job from the rendered container specs."""
import subprocess

import pytest

from harness import PY
from kvps.errors import ConfigError
from kvps.launch import k8s

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kvps[test] (kubernetes-validate)")
K8S_VERSION = "1.30.0"      # pod-index labels (1.28) and Indexed Jobs (1.24) are both there


def _by_kind(docs):
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _env(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("workers,servers,gpus", [(2, 2, 0), (4, 1, 1), (3, 0, 0)])
def test_manifests_validate_against_the_openapi_schemas(workers, servers, gpus):
    docs = k8s.render(workers, servers, "registry.example/train:1", ["python", "train.py", "--lr", "0.1"],
                      name="mnist", namespace="team-a", env={"KVPS_LOG_LEVEL": "INFO"},
                      resources=k8s.Resources(gpus=gpus))
    for doc in docs:
        for version in (K8S_VERSION, kubernetes_validate.utils.latest_version()):
            kubernetes_validate.validate(doc, version, strict=True)     # raises ValidationError
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Secret", "Pod", "Service"] + (["Service", "StatefulSet"] if servers else []) + ["Job"]
    assert all(d["metadata"]["namespace"] == "team-a" for d in docs)


def test_roles_are_wired_like_an_mxjob():
    docs = _by_kind(k8s.render(2, 3, "img:1", ["python", "train.py"], name="mnist", port=9200,
                               resources=k8s.Resources(cpu="4", memory="8Gi", gpus=1)))
    sched_svc = docs[("Service", "mnist-scheduler")]
    assert sched_svc["spec"]["ports"][0]["port"] == 9200 and "clusterIP" not in sched_svc["spec"]
    assert docs[("Service", "mnist-server")]["spec"]["clusterIP"] == "None"
    sts = docs[("StatefulSet", "mnist-server")]["spec"]
    assert sts["replicas"] == 3 and sts["serviceName"] == "mnist-server"
    assert sts["selector"]["matchLabels"] == sts["template"]["metadata"]["labels"]
    job = docs[("Job", "mnist-worker")]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"]) == ("Indexed", 2, 2)
    worker = job["template"]["spec"]["containers"][0]
    assert worker["command"] == ["python", "train.py"]
    assert worker["resources"] == {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"nvidia.com/gpu": 1}}
    env = _env(worker)
    assert env["KVPS_SCHEDULER"] == "mnist-scheduler:9200" and env["KVPS_ROLE"] == "worker"
    assert (env["DMLC_PS_ROOT_URI"], env["DMLC_PS_ROOT_PORT"], env["DMLC_NUM_SERVER"]) == ("mnist-scheduler", "9200", "3")
    assert env["KVPS_RANK"]["fieldRef"]["fieldPath"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    server_env = _env(sts["template"]["spec"]["containers"][0])
    assert server_env["KVPS_RANK"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert server_env["KVPS_HOST"]["fieldRef"]["fieldPath"] == "status.podIP"
    sched = docs[("Pod", "mnist-scheduler")]["spec"]
    assert sched["restartPolicy"] == "Never" and "-n" in sched["containers"][0]["command"]
    assert sched_svc["spec"]["selector"] == docs[("Pod", "mnist-scheduler")]["metadata"]["labels"]
    for spec in (sched, sts["template"]["spec"], job["template"]["spec"]):
        assert spec["volumes"] == [{"name": "keys", "secret": {"secretName": "mnist-keys", "defaultMode": 0o400}}]
    assert _env(worker)["KVPS_SECRET_FILE"] == "/etc/kvps/keys/W$(KVPS_RANK).json"
    assert _env(sched["containers"][0])["KVPS_SECRET_FILE"] == "/etc/kvps/keys/H.json"
    assert docs[("Secret", "mnist-keys")]["data"] == {}          # no keys= given: a placeholder


def test_the_secret_holds_one_key_file_per_node():
    import base64
    import json
    docs = k8s.render(2, 1, "img:1", ["python", "t.py"], keys=k8s.secret_data(2, 1))
    kubernetes_validate.validate(docs[0], K8S_VERSION, strict=True)
    files = {n: json.loads(base64.b64decode(v)) for n, v in docs[0]["data"].items()}
    assert sorted(files) == ["H.json", "S0.json", "W0.json", "W1.json"]
    assert all(list(f["secret"]) == [n[:-5]] and sorted(f["public"]) == ["H", "S0", "W0", "W1"]
               for n, f in files.items())


def test_a_broken_manifest_is_caught_by_the_validator():
    """The validator is strict: the check above means something."""
    job = k8s.render(1, 1, "img:1", ["python", "t.py"])[-1]
    job["spec"]["completionMode"] = "indexed"
    job["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy2"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


@pytest.mark.parametrize("kwargs,why", [
    ({"name": "My_Job"}, "--name 'My_Job' must be a DNS label"),
    ({"image": "a b"}, "--image 'a b' is not an image reference"),
    ({"port": 70000}, "--port 70000 is not a port number"),
    ({"env": {"1X": "y"}}, "are not environment variable names"),
    ({"command": []}, "no worker command given"),
    ({"restart_workers": 2}, "--restart-workers 2: .* only with --elastic"),
])
def test_bad_arguments_are_named(kwargs, why):
    args = dict(dict(num_workers=1, num_servers=1, image="img:1", command=["python", "t.py"]), **kwargs)
    with pytest.raises(ConfigError, match=why.replace("(", r"\(")):
        k8s.render(**args)
    with pytest.raises(ConfigError, match="--memory '2GB' is not a Kubernetes quantity"):
        k8s.Resources(memory="2GB")


def test_an_elastic_job_restarts_failed_workers_in_place():
    """--elastic --restart-workers 3: every node gets KVPS_ELASTIC=1, and a failed worker's container
    starts again in its pod (same completion index, so the same KVPS_RANK), at most 3 times."""
    docs = k8s.render(3, 2, "img:1", ["python", "train.py"], name="mnist", elastic=True, restart_workers=3)
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    by = _by_kind(docs)
    job = by[("Job", "mnist-worker")]["spec"]
    assert job["backoffLimit"] == 3 and job["template"]["spec"]["restartPolicy"] == "OnFailure"
    for key in (("Pod", "mnist-scheduler"), ("StatefulSet", "mnist-server")):
        spec = by[key]["spec"] if key[0] == "Pod" else by[key]["spec"]["template"]["spec"]
        assert _env(spec["containers"][0])["KVPS_ELASTIC"] == "1"
    plain = _by_kind(k8s.render(3, 2, "img:1", ["python", "train.py"], name="mnist"))[("Job", "mnist-worker")]["spec"]
    assert plain["backoffLimit"] == 0 and plain["template"]["spec"]["restartPolicy"] == "Never"


def test_cli_writes_a_yaml_stream(tmp_path):
    yaml = pytest.importorskip("yaml")
    out = tmp_path / "job.yaml"
    proc = subprocess.run([PY, "-m", "kvps.cli", "k8s", "render", "-n", "2", "-s", "1", "--image", "img:1",
                           "-o", str(out), "--", "python", "train.py"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(out.read_text()))
    assert docs[1:] == k8s.render(2, 1, "img:1", ["python", "train.py"])[1:]
    assert sorted(docs[0]["data"]) == ["H.json", "S0.json", "W0.json", "W1.json"]     # fresh keys
    assert out.stat().st_mode & 0o077 == 0                     # it holds secret keys
