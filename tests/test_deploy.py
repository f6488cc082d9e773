"""deploy/ manifests parse and carry what KubeRay, the Ray cluster launcher and Docker need, and every
`soma ...` command line in deploy/ and the docs names commands and options the CLI really has."""

import re
import shlex
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import typer
import yaml
from typer._click import exceptions as click_exceptions  # typer 0.29's click

from pipelines.cli import app
from soma_cluster.errors import SomaError

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
YAMLS = sorted(DEPLOY.rglob("*.yaml"))
RAY_VERSION = version("ray")


def pinned(name: str) -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d.split("==")[1] for d in deps if d.split("==")[0].split("[")[0] == name)  # "ray[data]==x": ray


def load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def by_kind(kind: str) -> list[tuple[Path, dict]]:
    return [(p, d) for p in YAMLS for d in load(p) if isinstance(d, dict) and d.get("kind") == kind]


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_parses(path):
    assert load(path), f"{path} holds no YAML document"


def check_ray_cluster_spec(spec: dict, where: str) -> None:
    assert spec["rayVersion"] == RAY_VERSION, where
    head = spec["headGroupSpec"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values()), (
        f"{where}: rayStartParams values must be strings"
    )
    assert head["template"]["spec"]["containers"][0]["image"], where
    groups = spec["workerGroupSpecs"]
    assert groups, f"{where}: no worker group"
    gpu_groups = 0
    for g in groups:
        assert g["groupName"] and g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], where
        assert all(isinstance(v, str) for v in g["rayStartParams"].values()), where
        res = g["template"]["spec"]["containers"][0]["resources"]
        gpus = res["limits"].get("nvidia.com/gpu")
        if gpus is not None:
            gpu_groups += 1
            assert res["requests"]["nvidia.com/gpu"] == gpus, f"{where}: GPU request != limit"
            assert g["rayStartParams"]["num-gpus"] == str(gpus), f"{where}: Ray must see the pod's GPUs"
    assert gpu_groups, f"{where}: no worker group with nvidia.com/gpu"


def test_raycluster_has_head_and_gpu_worker_group():
    clusters = by_kind("RayCluster")
    assert clusters
    for path, doc in clusters:
        assert doc["apiVersion"] == "ray.io/v1"
        check_ray_cluster_spec(doc["spec"], str(path))


def test_rayjob_runs_soma_launch_on_a_cluster():
    jobs = by_kind("RayJob")
    assert jobs
    names = {d["metadata"]["name"] for _, d in by_kind("RayCluster")}
    entrypoints = []
    for path, doc in jobs:
        spec = doc["spec"]
        assert doc["apiVersion"] == "ray.io/v1" and spec["entrypoint"].strip().startswith("soma "), path
        entrypoints.append(spec["entrypoint"])
        if "rayClusterSpec" in spec:
            check_ray_cluster_spec(spec["rayClusterSpec"], str(path))
        else:
            assert spec["clusterSelector"]["ray.io/cluster"] in names, f"{path}: selects no RayCluster defined here"
    assert any(re.search(r"soma launch s3://\S+", e) for e in entrypoints)
    assert any(re.search(r"soma resume s3://\S+", e) for e in entrypoints)


def test_cluster_launcher_yaml():
    [cfg] = load(DEPLOY / "cluster.yaml")
    for key in (
        "cluster_name",
        "max_workers",
        "provider",
        "head_node_type",
        "available_node_types",
        "head_start_ray_commands",
        "worker_start_ray_commands",
    ):
        assert key in cfg, key
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types and cfg["provider"]["type"]
    gpu = [t for name, t in types.items() if name != cfg["head_node_type"] and t["resources"].get("GPU", 0) > 0]
    assert gpu and all(t["max_workers"] >= t["min_workers"] >= 0 and t["node_config"] for t in gpu)
    assert sum(t["max_workers"] for t in gpu) <= cfg["max_workers"]
    assert any("ray start --head" in c for c in cfg["head_start_ray_commands"])
    assert any("ray start --address" in c for c in cfg["worker_start_ray_commands"])


def test_dockerfile_builds_both_variants_from_the_pins():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(rf"ARG RAY_IMAGE=rayproject/ray:{re.escape(pinned('ray'))}-py311\n", text)
    assert "ARG VARIANT=gpu" in text and "FROM ${RAY_IMAGE}-${VARIANT}" in text
    assert re.search(r'"\$VARIANT" = "cpu"', text) and f'"torch=={pinned("torch")}"' in text
    # the pinned dependencies are installed in a layer of their own, before any code is copied in
    deps, code = text.index("pip install -r /tmp/requirements.txt"), text.index("COPY --chown=ray:users soma_cluster")
    assert text.index("COPY --chown=ray:users pyproject.toml") < deps < code < text.index("pip install --no-deps .")
    assert re.search(r"apt-get install .*\bgcc\b", text)  # soma_cluster/fused.py builds its kernels at first use
    images = {
        c["image"]
        for _, d in by_kind("RayCluster")
        for g in [d["spec"]["headGroupSpec"], *d["spec"]["workerGroupSpecs"]]
        for c in g["template"]["spec"]["containers"]
    }
    assert {i.rsplit(":", 1)[1] for i in images} == {"cpu", "gpu"}


# -- `soma ...` command lines --------------------------------------------------------------------------
SOMA = re.compile(r"(?<![\w/.-])soma ([a-z][\w-]*)((?:[^\"`;&#|]|\|(?!\s))*)")


def strings(node) -> list[str]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return [node] if isinstance(node, str) else []


def command_contexts(path: Path) -> list[str]:
    """Text that holds command lines: YAML string values (a folded entrypoint is one string), Dockerfile
    instructions, and indented example comments (`#   soma ...`, not prose) in deploy files; code
    blocks and `code spans` in Markdown."""
    text = path.read_text()
    if path.suffix == ".md":
        blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
        rest = re.sub(r"```.*?```", "", text, flags=re.S)
        return [line.split(" # ")[0] for b in blocks for line in b.splitlines()] + [
            span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", rest)
        ]
    lines = text.splitlines()
    out = [line.lstrip()[1:] for line in lines if line.lstrip().startswith("#  ")]
    if path.suffix == ".yaml":
        return out + [s for doc in load(path) for s in strings(doc)]
    return out + [line for line in lines if not line.lstrip().startswith("#")]


def soma_command_lines() -> list[tuple[str, str]]:
    found = []
    for path in [*DEPLOY.rglob("*"), *DOCS]:
        if path.is_file():
            for ctx in command_contexts(path):
                for m in SOMA.finditer(ctx):
                    found.append((str(path.relative_to(ROOT)), f"soma {m.group(1)}{m.group(2)}".strip()))
    return found


def check_command(line: str, group) -> None:
    tokens = [t.strip("[]") for t in shlex.split(line)[1:]]
    tokens = [t for t in tokens if t and t != "..."]
    name, rest = tokens[0], tokens[1:]
    assert name in group.commands, f"{line!r}: no command {name!r} (have {sorted(group.commands)})"
    cmd = group.commands[name]
    # typer 0.29 ships its own copy of click: tell options from arguments by click's param_type_name
    options = {o: p for p in cmd.params if p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)}
    arity = sum(p.nargs if p.nargs >= 0 else 99 for p in cmd.params if p.param_type_name == "argument")
    positional, i = 0, 0
    while i < len(rest):
        tok = rest[i]
        if tok.startswith("-") and tok != "-":
            opt = tok.split("=", 1)[0]
            assert opt in options or opt == "--help", f"{line!r}: {name} has no option {opt} (have {sorted(options)})"
            if opt != "--help" and not options[opt].is_flag and "=" not in tok:
                i += 1  # the option's value
        else:
            positional += 1
        i += 1
    assert positional <= arity, f"{line!r}: {name} takes {arity} argument(s), given {positional}"


def test_every_soma_command_line_exists_in_the_cli():
    group = typer.main.get_command(app)
    lines = soma_command_lines()
    where = {f for f, _ in lines}
    assert {"deploy/Dockerfile", "deploy/cluster.yaml", "deploy/kuberay/rayjob.yaml", "docs/cluster.md"} <= where, where
    for path, line in lines:
        try:
            check_command(line, group)
        except AssertionError as exc:
            raise AssertionError(f"{path}: {exc}") from None


def test_the_checker_catches_a_wrong_command_or_option():
    group = typer.main.get_command(app)
    check_command("soma launch s3://b/c --address auto --no-progress", group)
    for bad in (
        "soma start s3://b/c",
        "soma launch s3://b/c --adress auto",
        "soma status s3://b/c extra",
        "soma prepare s3://b/c --presets tiny",
    ):
        with pytest.raises(AssertionError):
            check_command(bad, group)


# -- the docs' examples, through the real parser -------------------------------------------------------
EXAMPLE = re.compile(r"^\s*(?:\$\s+)?((?:[A-Z_]+=\S+\s+)*soma\s.*)$")  # `soma ...`, `$ soma ...`, `VAR=x soma ...`
SYNOPSIS = re.compile(r"[\[\]|]|\.\.\.")  # `[--json]`, `small|paper`, `...`: a usage line, not an example
SETS_CONFIG = {"prepare", "demo", "fork", "experiment"}  # their --set items are config overrides


def example_blocks() -> list[tuple[str, list[str]]]:
    """Each code block of the docs, and of deploy/ each command line, with its `soma ...` commands: continuation
    lines joined, a trailing comment dropped, `a && b` two commands."""
    out = []
    for path in DOCS:
        for block in re.findall(r"```[^\n]*\n(.*?)```", path.read_text(), flags=re.S):
            lines = []
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                if m := EXAMPLE.match(line):
                    lines += [c.strip() for c in re.split(r"\s(?:&&|;)\s", m.group(1).split("  #")[0])]
            if lines:
                commands = [c for c in lines if _env_prefix(c)[1].startswith("soma ")]
                out.append((str(path.relative_to(ROOT)), commands))
    deploy = [(path, [line]) for path, line in soma_command_lines() if path.startswith("deploy/")]
    return out + deploy


def check_example(line: str, group, configs: dict[str, object]) -> None:
    """`line` parsed by the command's own parser (types, bounds, option callbacks, a value given twice), its option
    pairs checked, and its --set items (and soma set's changes) validated as the command validates them, on the
    config an earlier line of the same block made for that campaign (else the tiny preset's)."""
    from pipelines.cli_harness import check_pairs
    from soma_cluster.config import parse_overrides, resolve
    from soma_cluster.revisions import check as check_revision

    env, line = _env_prefix(line)
    if SYNOPSIS.search(line):
        return check_command(line, group)  # names only: its values are placeholders
    args = shlex.split(line)[1:]
    if args[0].startswith("-"):
        assert args[0] in ("--version", "--help"), line  # the group's own options
        return None
    cmd = group.commands[args[0]]
    try:
        ctx = cmd.make_context(args[0], args[1:])
        check_pairs(ctx)
    except (click_exceptions.ClickException, typer.Exit) as exc:
        raise AssertionError(f"{line!r}: {getattr(exc, 'message', exc)!r}") from None
    check_address(args[0], ctx.params.get("address"), env)
    where = ctx.params.get("campaign")
    base = configs.get(where) or resolve("tiny")
    if args[0] in SETS_CONFIG and ctx.params.get("set") and not ctx.params.get("config"):
        preset = ctx.params.get("preset") or "tiny"
        configs[where] = resolve(preset, parse_overrides(list(ctx.params["set"])))
    if args[0] == "set":
        check_revision(base, list(ctx.params["changes"]), driver_running=False)
    if args[0] == "resume" and ctx.params.get("set"):
        check_revision(base, list(ctx.params["set"]), driver_running=False, origin="--set")


def _env_prefix(line: str) -> tuple[dict[str, str], str]:
    """`VAR=x VAR2=y soma ...` -> ({VAR: x, VAR2: y}, `soma ...`)."""
    env = {}
    while m := re.match(r"([A-Z_]+)=(\S+)\s+", line):
        env[m.group(1)] = m.group(2)
        line = line[m.end() :]
    return env, line


def check_address(command: str, address: str | None, env: dict[str, str]) -> None:
    """The example's --address (else its RAY_ADDRESS=) in a form that command takes: the command's own parse and
    form check, without the network (soma serve alone takes ray:// and http:// forms)."""
    from pipelines.rayaddress import check_form, parse

    if address is None and "RAY_ADDRESS" not in env:
        return
    serve = command == "serve"
    check_form(parse(address, env, serve=serve), serve=serve)


def test_every_example_in_the_docs_parses_with_its_values():
    group = typer.main.get_command(app)
    blocks = example_blocks()
    assert sum(len(b) for _, b in blocks) >= 40, blocks
    for path, lines in blocks:
        configs: dict[str, object] = {}
        for line in lines:
            try:
                check_example(line, group, configs)
            except (AssertionError, SomaError) as exc:
                raise AssertionError(f"{path}: {line!r}: {exc}") from None


def test_the_example_checker_catches_a_wrong_value():
    group = typer.main.get_command(app)
    check_example("soma prepare c --preset paper-small --set n_experts=8", group, {})
    check_example("soma serve s3://b/x --address ray://head:10001 --detach", group, {})
    check_example("RAY_ADDRESS=http://127.0.0.1:8265 soma serve s3://b/x --detach", group, {})
    for bad in (
        "soma plan c --gpus K",  # not a number
        "soma prepare c --preset huge",  # not a preset
        "soma status c --interval 5",  # needs --watch
        "soma prepare c --set n_experts=0",  # out of the setting's bounds
        "soma set c train.method=bptt",  # not revisable
        "soma eval c --stride 0",  # below the option's bound
        "soma launch c --address ray://head:10001",  # Ray Client: soma serve's only
        "RAY_ADDRESS=http://head:8265 soma launch c",  # a dashboard: soma serve's only
        "soma serve c --address ray://head",  # no port
    ):
        with pytest.raises((AssertionError, SomaError)):
            check_example(bad, group, {})


RUNNABLE = ("status", "presets", "sample", "--version")  # read only, quick on a tiny campaign


def test_the_docs_read_only_examples_run_on_a_tiny_campaign(trained):
    """Each example of a command that only reads, run on the session's trained campaign in place of the one the
    docs name: it works as shown (exit 0)."""
    from conftest import soma_here

    ran = []
    for path, lines in example_blocks():
        for line in lines:
            env, line = _env_prefix(line)
            args = shlex.split(line)[1:]
            if args[0] not in RUNNABLE or SYNOPSIS.search(line) or env:
                continue
            if args[0] != "--version" and args[0] != "presets":
                args[1] = str(trained.camp)  # the campaign the docs name: runs/demo, s3://...
            if args in ran:
                continue  # the same example on another campaign: the same run here
            result = soma_here(*args)
            assert result.returncode == 0, (path, line, result.stderr[-1500:])
            ran.append(args)
    assert {"status", "sample", "--version"} <= {a[0] for a in ran}, ran


# -- closed to strangers, elastic, sized --------------------------------------------------------------
def containers(spec: dict) -> list[dict]:
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def token_from_secret(container: dict) -> bool:
    env = {e["name"]: e for e in container.get("env", [])}
    mode = env.get("RAY_AUTH_MODE", {}).get("value")
    ref = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {})
    return mode == "token" and ref.get("name") == "soma-ray-auth" and ref.get("key") == "auth_token"


def test_kuberay_clusters_use_token_auth_everywhere_and_start_with_no_gpu_workers():
    specs = [(p, d["spec"]) for p, d in by_kind("RayCluster")] + [
        (p, d["spec"]["rayClusterSpec"]) for p, d in by_kind("RayJob") if "rayClusterSpec" in d["spec"]
    ]
    assert specs
    for path, spec in specs:
        assert all(token_from_secret(c) for c in containers(spec)), f"{path}: a Ray container without the token"
        assert token_from_secret({"env": spec["autoscalerOptions"]["env"]}), (
            f"{path}: the autoscaler needs the token too"
        )
        assert spec["enableInTreeAutoscaling"] is True
        for g in spec["workerGroupSpecs"]:
            assert g["minReplicas"] == 0 and g["replicas"] == 0, f"{path}: GPU workers start at zero and grow on demand"
        for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            store = int(g["rayStartParams"]["object-store-memory"])
            shm = [v for v in g["template"]["spec"]["volumes"] if v["name"] == "dshm"][0]["emptyDir"]["sizeLimit"]
            assert store < int(shm.removesuffix("Gi")) * 2**30, f"{path}: the object store must fit in /dev/shm"
    for path, doc in by_kind("RayJob"):
        submitter = doc["spec"]["submitterPodTemplate"]["spec"]["containers"][0]
        assert token_from_secret(submitter), f"{path}: the job submitter needs the token"


def test_every_service_account_named_is_defined_with_a_cloud_role():
    accounts = {d["metadata"]["name"]: d for _, d in by_kind("ServiceAccount")}
    named = {s for p in YAMLS for doc in load(p) for s in re.findall(r"'serviceAccountName': '([\w-]+)'", str(doc))}
    assert named and named <= set(accounts), (named, set(accounts))
    for name in named:
        assert any(
            k.endswith("role-arn") or k.endswith("gcp-service-account")
            for k in accounts[name]["metadata"]["annotations"]
        )


def test_launcher_cluster_ships_the_token_and_starts_ray_with_it():
    [cfg] = load(DEPLOY / "cluster.yaml")
    assert "~/.ray/auth_token" in cfg["file_mounts"]
    assert any("RAY_AUTH_MODE=token" in o for o in cfg["docker"]["run_options"])
    assert all(
        "RAY_AUTH_MODE=token ray start" in c
        for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
        if "ray start" in c
    )
    assert all(
        t.get("min_workers", 0) == 0 for name, t in cfg["available_node_types"].items() if name != cfg["head_node_type"]
    )


def test_docs_submit_the_driver_as_a_ray_job():
    text = (ROOT / "docs" / "cluster.md").read_text() + (DEPLOY / "cluster.yaml").read_text()
    assert re.search(r"ray job submit[^\n]*-- soma launch", text) and re.search(
        r"ray job submit[^\n]*-- soma resume", text
    )
    assert "--tmux" not in text and "ray://" not in text.replace("Not as a `ray://` client", "")


def kuberay_pod_labels(cluster_name: str, node_type: str, group: str, template: dict) -> dict[str, str]:
    """The labels KubeRay v1.4 puts on a head or worker pod (ray-operator/controllers/ray/common/pod.go, names from
    utils/constant.go), over the template's own."""
    return {
        **(template.get("metadata", {}).get("labels") or {}),
        "ray.io/cluster": cluster_name,
        "ray.io/node-type": node_type,
        "ray.io/group": group,
        "ray.io/identifier": f"{cluster_name}-{node_type}",
        "ray.io/is-ray-node": "yes",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }


def ray_pods(cluster_name: str, spec: dict) -> list[dict[str, str]]:
    pods = [kuberay_pod_labels(cluster_name, "head", "headgroup", spec["headGroupSpec"]["template"])]
    for group in spec.get("workerGroupSpecs", []):
        pods.append(kuberay_pod_labels(cluster_name, "worker", group["groupName"], group["template"]))
    return pods


def test_the_podmonitor_scrapes_every_ray_pod_of_every_cluster_and_no_submitter():
    """A RayJob's cluster is named <rayjob>-<5 random characters> (utils.GenerateRayClusterName): a selector on
    the cluster's name never matches it. Every head and worker pod the manifests make must match; the RayJob's
    submitter pod (a K8s Job's, without the Ray node label) must not."""
    [(_, monitor)] = by_kind("PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert "ray.io/cluster" not in selector, selector
    pods = [pod for path, doc in by_kind("RayCluster") for pod in ray_pods(doc["metadata"]["name"], doc["spec"])]
    for _, job in by_kind("RayJob"):
        if "rayClusterSpec" in job["spec"]:
            pods += ray_pods(f"{job['metadata']['name']}-x7k2q", job["spec"]["rayClusterSpec"])
            submitter = (job["spec"].get("submitterPodTemplate") or {}).get("metadata", {}).get("labels") or {}
            assert not selector.items() <= submitter.items(), submitter
    assert len(pods) >= 6
    for pod in pods:
        assert selector.items() <= pod.items(), (selector, pod)
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "metrics"
    targets = {r["targetLabel"] for r in endpoint.get("relabelings", [])}
    assert "ray_cluster" in targets  # campaigns on different clusters stay apart on the dashboard


# -- deploy/kuberay/rayservice.yaml: the upstream CRD, Ray Serve's own config schema, our application's args ---------
def _rayservice() -> dict:
    return yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())


def test_rayservice_is_valid_against_kuberays_crd():
    import gzip

    import jsonschema

    crd = yaml.safe_load(gzip.decompress((ROOT / "tests/data/kuberay/ray.io_rayservices.yaml.gz").read_bytes()))
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    doc = _rayservice()
    jsonschema.validate(doc, schema)  # raises with the path of the first violation
    assert (doc["apiVersion"], doc["kind"]) == (f"{crd['spec']['group']}/v1", crd["spec"]["names"]["kind"])
    bad = {**doc, "spec": {**doc["spec"], "serveConfigV2": 7}}  # the check can fail: a number is not a config
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_rayservice_serve_config_is_ours_and_valid_for_ray_serve():
    pytest.importorskip("ray.serve.schema")
    from ray.serve.schema import ServeDeploySchema

    from pipelines.serve_app import build
    from soma_cluster.inference.serveinput import APP_NAME, settings

    doc = _rayservice()
    config = ServeDeploySchema.model_validate(yaml.safe_load(doc["spec"]["serveConfigV2"]))
    (app,) = config.applications
    module, _, attr = app.import_path.partition(":")
    assert (module, attr, app.name) == ("pipelines.serve_app", "build", APP_NAME)
    assert settings(app.args).source.startswith("s3://")  # the args are soma serve's settings, every one valid
    build(app.args)  # the builder accepts them (it loads nothing: the replicas do)
    assert doc["spec"]["rayClusterConfig"]["rayVersion"] == version("ray")
    for container in [
        *doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"],
        *(c for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]),
    ]:
        assert {"name": "RAY_AUTH_MODE", "value": "token"} in container["env"]  # closed to strangers, as the rest
        assert {"containerPort": 8000, "name": "serve"} in container["ports"]  # a proxy on every node
