"""deploy/kubernetes: the manifests are whole and agree with the server they run. The Deployment's container
arguments are started as they stand (the model path swapped for a tiny model, on the CPU): every probe's
path answers 200, the Prometheus path exports the metric names vLLM-aware gateways and autoscalers read,
and SIGTERM drains and exits 0 well within the termination grace period."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

yaml = pytest.importorskip("yaml")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KUBE = os.path.join(ROOT, "deploy", "kubernetes")
# what the Gateway API inference extension and KEDA/HPA recipes for vLLM scrape
VLLM_NAMES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
              "vllm:gpu_cache_usage_perc")


def _docs() -> dict[str, dict]:
    out = {}
    for name in sorted(os.listdir(KUBE)):
        if name.endswith(".yaml"):
            with open(os.path.join(KUBE, name)) as f:
                out[name] = yaml.safe_load(f)
    return out


def _deployment() -> dict:
    return next(d for d in _docs().values() if d["kind"] == "Deployment")


def test_kustomization_lists_every_manifest_and_they_select_one_app():
    docs = _docs()
    kustomization = docs.pop("kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(docs)
    dep = _deployment()
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for d in docs.values():
        selector = d["spec"].get("selector")
        if d["kind"] in ("Service",):
            assert selector.items() <= labels.items()
        elif d["kind"] in ("PodDisruptionBudget", "ServiceMonitor"):
            assert selector["matchLabels"].items() <= labels.items()
    claim = dep["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim in {d["metadata"]["name"] for d in docs.values() if d["kind"] == "PersistentVolumeClaim"}


def test_container_asks_for_a_gpu_and_its_probes_and_ports_agree():
    pod = _deployment()["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    port = c["ports"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port["containerPort"])
    args = c["args"]
    assert args[args.index("--port") + 1] == str(port["containerPort"]) and args[args.index("--host") + 1] == "0.0.0.0"
    service = next(d for d in _docs().values() if d["kind"] == "Service")
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    # the pod leaves the Service's endpoints during preStop, then drains within the grace period
    assert pod["spec"]["terminationGracePeriodSeconds"] > int(c["lifecycle"]["preStop"]["exec"]["command"][-1])


def test_the_image_listens_on_every_interface():
    """The image's entrypoint serves on 0.0.0.0 (`docker run -p 8000:8000 IMAGE /models/M` reaches it; the
    CLI's default is loopback), on the port it exposes; arguments after it still override."""
    import json
    from tokenmill import cli
    text = open(os.path.join(ROOT, "deploy", "Dockerfile")).read()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    exposed = re.search(r"^EXPOSE (\d+)$", text, re.M).group(1)
    assert entry[:2] == ["tokenmill", "serve"]
    args = cli.build_parser()[0].parse_args([*entry[1:], "/models/M"])
    assert (args.host, str(args.port)) == ("0.0.0.0", exposed)
    assert cli.build_parser()[0].parse_args([*entry[1:], "/models/M", "--host", "::"]).host == "::"


def test_the_image_has_the_c_compiler_triton_builds_its_launchers_with():
    """Triton compiles its driver module and every kernel launcher from C at run time (gcc, else clang,
    else $CC); python:*-slim ships no compiler, so the first kernel failed with "Failed to find C compiler"."""
    text = open(os.path.join(ROOT, "deploy", "Dockerfile")).read()
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    installed = " ".join(re.findall(r"apt-get install ([^&\n]*)", text))
    assert "slim" not in base or re.search(r"(?<![\w-])(gcc|clang)(?![\w-])", installed), (base, installed)


def test_compiled_kernels_outlive_a_container_restart():
    """Triton's cache is on a writable pod volume, not in the container's own layer, which a restart
    discards: a restarted server finds its kernels compiled (docs/DEPLOY.md)."""
    pod = _deployment()["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    cache = next(e["value"] for e in c["env"] if e["name"] == "TRITON_CACHE_DIR")
    mount = next(m for m in c["volumeMounts"] if cache.startswith(m["mountPath"].rstrip("/") + "/"))
    assert not mount.get("readOnly", False)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume


def test_the_deployments_arguments_serve_drain_and_export_vllms_names(qwen3_dir, tmp_path):
    pod = _deployment()["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    args = list(c["args"])
    args[0] = qwen3_dir                                   # the checkpoint on the volume -> a tiny model
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    log = open(tmp_path / "server.log", "w")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", *args, "--device", "cpu",
                             "--num-kv-blocks", "64", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.2)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert httpx.get(url + c[probe]["httpGet"]["path"], timeout=5).status_code == 200
        served = args[args.index("--served-model-name") + 1]
        r = httpx.post(url + "/v1/completions", json={"model": served, "prompt": "def", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        text = httpx.get(url + pod["metadata"]["annotations"]["prometheus.io/path"], timeout=10).text
        for name in VLLM_NAMES:
            assert re.search(rf'^{name}{{model_name="{served}"}} ', text, re.M), name
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(pod["spec"]["terminationGracePeriodSeconds"]) == 0, (tmp_path / "server.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def _unit() -> dict[str, str]:
    fields = {}
    for line in open(os.path.join(ROOT, "deploy", "systemd", "tokenmill.service")):
        if "=" in line and not line.startswith("#"):
            key, value = line.rstrip("\n").split("=", 1)
            fields[key] = value
    return fields


def test_the_systemd_unit_serves_on_loopback_where_nginx_points_and_drains_before_it_is_killed():
    from tokenmill import cli
    unit = _unit()
    command = unit["ExecStart"].split()
    assert command[0].endswith("/tokenmill") and command[1] == "serve"
    args = cli.build_parser()[0].parse_args(command[1:])
    assert args.host == "127.0.0.1"
    nginx = open(os.path.join(ROOT, "deploy", "nginx", "tokenmill.conf")).read()
    assert re.search(r"^\s*server 127\.0\.0\.1:(\d+);", nginx, re.M).group(1) == str(args.port)
    # SIGTERM to the main process alone (it drains; the core and API servers ignore it), with as long to
    # finish requests in flight as a Kubernetes pod has
    assert (unit["KillSignal"], unit["KillMode"]) == ("SIGTERM", "mixed")
    pod = _deployment()["spec"]["template"]["spec"]
    assert int(unit["TimeoutStopSec"]) >= pod["terminationGracePeriodSeconds"]
    assert unit["Restart"] == "on-failure" and unit["RestartPreventExitStatus"] == "2"
    with pytest.raises(SystemExit) as refused:                 # a flag it does not know: exit 2, not retried
        cli.build_parser()[0].parse_args([*command[1:], "--no-such-flag"])
    assert refused.value.code == 2


def test_nginx_lets_go_of_idle_connections_first_and_takes_the_bodies_the_server_takes():
    from tokenmill.server.http_server import HTTPOptions
    nginx = open(os.path.join(ROOT, "deploy", "nginx", "tokenmill.conf")).read()
    upstream = re.search(r"upstream tokenmill \{(.*?)\}", nginx, re.S).group(1)
    idle = float(re.search(r"keepalive_timeout (\d+)s;", upstream).group(1))
    assert idle < HTTPOptions().timeout_keep_alive
    body = re.search(r"client_max_body_size (\d+)m;", nginx).group(1)
    assert int(body) * 1024 * 1024 == HTTPOptions().max_request_body_bytes
    location = re.search(r"location / \{(.*?)\}", nginx, re.S).group(1)
    assert "proxy_buffering off;" in location and "proxy_http_version 1.1;" in location
