"""deploy/: every ``ddiloco`` command line of the Slurm script, the Kubernetes manifests and
docs/deploy.md is one the CLI accepts, with flags that exist as spelled (no abbreviations),
and the pieces around it agree (ids, addresses, mounted files, the number of learners).

Where the command lines come from:

- Kubernetes: the manifests are loaded with ``yaml.safe_load_all`` following each
  kustomization's ``resources`` and applying its JSON patches (only ``add``, which is all the
  overlays use); a container's ``command`` + ``args`` is the command line, with ``$(VAR)``
  expanded from the container's ``env`` as Kubernetes does (a pod name from ``fieldRef``
  becomes the first pod's name).
- Slurm: bash runs the script with stubs for ``srun``, ``scontrol``, ``torchrun``, ``ddiloco``
  and ``scancel`` first on PATH and the variables Slurm sets given plausible values; the
  ``srun`` stub records its argv and runs the rest, so the recorded command lines are the
  script's after the shell has expanded every variable, array and loop.
- docs/deploy.md: tests/test_docs_commands.py, with the other pages.

The Slurm script under a real Slurm: tests/test_deploy_slurm.py.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml

from cli_lines import _parser, check_command
from ddiloco.commands.options import config_from_args
from ddiloco.runtime.sync.resume import Resume

REPO = Path(__file__).resolve().parents[1]
KUBERNETES = REPO / "deploy" / "kubernetes"
SBATCH = REPO / "deploy" / "slurm" / "ddiloco.sbatch"


# ---- the checker ---------------------------------------------------------------------------


def ddiloco_argv(command: list[str]) -> list[str] | None:
    """The ``ddiloco`` arguments of a command line: ``ddiloco ARGS`` or ``torchrun ... -m ddiloco.cli ARGS``."""
    if command and PurePosixPath(command[0]).name == "ddiloco":
        return command[1:]
    for i in range(len(command) - 1):
        if command[i] == "-m" and command[i + 1] == "ddiloco.cli":
            return command[i + 2:]
    return None


def flag(argv: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in argv (None when absent)."""
    for i, token in enumerate(argv):
        if token == name:
            return argv[i + 1]
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
    return None


# ---- Kubernetes ----------------------------------------------------------------------------

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches"}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}


def _json_patch_add(doc: dict, op: dict) -> None:
    assert op["op"] == "add", f"only 'add' patches are understood here, got {op}"
    *parents, last = op["path"].lstrip("/").split("/")
    node = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
    else:
        node[last] = copy.deepcopy(op["value"])


def kustomize(directory: Path) -> list[dict]:
    """The documents ``kubectl apply -k directory`` would apply (for what these files use)."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(spec) <= KUSTOMIZATION_KEYS, f"{directory}: kustomization keys this test does not emulate"
    docs: list[dict] = []
    for resource in spec.get("resources", []):
        path = directory / resource
        if path.is_dir():
            docs += kustomize(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in spec.get("patches", []):
        target = patch["target"]
        (doc,) = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        for op in yaml.safe_load(patch["patch"]):
            _json_patch_add(doc, op)
    return docs


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in command and args; an unknown name stays as written."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def _plausible_env(doc: dict, container: dict) -> dict[str, str]:
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = f"{doc['metadata']['name']}-0"  # a StatefulSet's first pod
        else:
            raise AssertionError(f"no plausible value for env {var} of {doc['metadata']['name']}")
    return env


def pod_containers(docs: list[dict]):
    """(workload document, pod spec, container, command line) for every container."""
    for doc in docs:
        if doc["kind"] in WORKLOAD_KINDS:
            pod = doc["spec"]["template"]["spec"]
            for container in pod.get("initContainers", []) + pod["containers"]:
                env = _plausible_env(doc, container)
                command = [_expand(str(x), env) for x in container.get("command", []) + container.get("args", [])]
                yield doc, pod, container, command


def manifest_commands(docs: list[dict]) -> list[tuple[dict, dict, dict, argparse.Namespace, list[str]]]:
    """Every container's ddiloco command line, checked; no container may run anything else."""
    found = []
    for doc, pod, container, command in pod_containers(docs):
        argv = ddiloco_argv(command)
        assert argv is not None, f"{doc['metadata']['name']}: not a ddiloco command line: {command}"
        unexpanded = [x for x in argv if "$(" in x]
        assert not unexpanded, f"{doc['metadata']['name']}: unexpanded {unexpanded}"
        found.append((doc, pod, container, check_command(argv), argv))
    return found


def mounted_file(pod: dict, container: dict, path: str) -> tuple[dict, str]:
    """The volume a file path of the container lives on, and the file's name inside it."""
    for mount in container.get("volumeMounts", []):
        root = PurePosixPath(mount["mountPath"])
        if PurePosixPath(path).is_relative_to(root):
            (volume,) = [v for v in pod.get("volumes", []) if v["name"] == mount["name"]]
            name = str(PurePosixPath(path).relative_to(root))
            source = volume.get("secret") or volume.get("configMap")
            if source is not None and "items" in source:
                keys = {item["path"]: item["key"] for item in source["items"]}
                assert name in keys, f"{path}: {name} is not among the items of volume {volume['name']}"
                name = keys[name]
            return volume, name
    raise AssertionError(f"{path} is on no volume mounted in container {container['name']}")


def test_every_manifest_parses_and_is_applied():
    for path in sorted(KUBERNETES.rglob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, path
        for doc in docs:
            assert doc.get("apiVersion") and doc.get("kind"), f"{path}: {doc}"
    # Every manifest file is in the base kustomization (none left out of what is checked).
    listed = set(yaml.safe_load((KUBERNETES / "base" / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in (KUBERNETES / "base").glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("overlay", ["base", "tls"])
def test_kubernetes_command_lines_are_accepted_and_consistent(overlay, tmp_path):
    docs = kustomize(KUBERNETES / overlay)
    commands = manifest_commands(docs)
    by_kind = {(doc["kind"], args.command): (doc, pod, container, args, argv)
               for doc, pod, container, args, argv in commands}
    assert len(by_kind) == len(commands) == 2
    sync_doc, sync_pod, sync_container, sync, sync_argv = by_kind["Deployment", "sync"]
    learners_doc, learner_pod, learner_container, learner, _ = by_kind["StatefulSet", "learner"]

    # The synchronizer: one pod at a time, its state on a claim defined here, resumed on restart.
    assert sync_doc["spec"]["replicas"] == 1
    assert sync_doc["spec"]["strategy"]["type"] == "Recreate"
    assert sync.resume is Resume.IF_PRESENT  # a fresh volume starts the run, every restart continues it
    state, _ = mounted_file(sync_pod, sync_container, sync.state_dir + "/CURRENT")
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert state["persistentVolumeClaim"]["claimName"] in claims

    # The token: a file from the Secret, on both sides.
    for pod, container, args in ((sync_pod, sync_container, sync), (learner_pod, learner_container, learner)):
        volume, key = mounted_file(pod, container, args.token_file)
        assert (volume["secret"]["secretName"], key) == ("ddiloco-token", "token")

    # Learners reach the synchronizer through its Service, on the port it listens on.
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == learner.connect.split(":")[0]]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == int(learner.connect.split(":")[1])]
    (container_port,) = [p for p in sync_container["ports"] if p["name"] == port["targetPort"]]
    assert container_port["containerPort"] == int(sync.listen.rsplit(":", 1)[1])
    assert all(service["spec"]["selector"][k] == v for k, v in sync_doc["spec"]["template"]["metadata"]["labels"].items())

    # Learner ids are the pods' names: learner-0 .. learner-(M-1), M = the synchronizer's --learners.
    replicas = learners_doc["spec"]["replicas"]
    assert learner.id == "learner-0"
    assert [f"{learners_doc['metadata']['name']}-{i}" for i in range(replicas)] == [f"learner-{i}" for i in range(replicas)]
    assert int(sync.learners) == replicas

    # The run's configuration (ConfigMap) builds: preset, TOML and the number of learners.
    volume, key = mounted_file(sync_pod, sync_container, sync.config)
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"]]
    local = tmp_path / "run.toml"
    local.write_text(config_map["data"][key])
    sync.config = str(local)
    assert config_from_args(sync).run.learners == replicas

    # TLS: the overlay gives the synchronizer its certificate and key, the learners the CA.
    if overlay == "tls":
        for args, pod, container, flags in ((sync, sync_pod, sync_container, {"tls_cert": "tls.crt", "tls_key": "tls.key"}),
                                            (learner, learner_pod, learner_container, {"tls_ca": "ca.crt"})):
            for dest, wanted in flags.items():
                volume, key = mounted_file(pod, container, getattr(args, dest))
                assert (volume["secret"]["secretName"], key) == ("ddiloco-tls", wanted)
    else:
        assert sync.tls_cert is None and learner.tls_ca is None


def test_a_broken_manifest_is_caught():
    docs = kustomize(KUBERNETES / "base")
    manifest_commands(docs)  # fine as written
    for wrong in ("--token-path", "--token"):  # unknown; an abbreviation argparse would accept
        broken = copy.deepcopy(docs)
        (learners,) = [d for d in broken if d["kind"] == "StatefulSet"]
        args = learners["spec"]["template"]["spec"]["containers"][0]["args"]
        args[args.index("--token-file")] = wrong
        with pytest.raises(AssertionError, match=re.escape(wrong)):
            manifest_commands(broken)


def test_the_parser_rejects_a_wrong_flag(capsys):
    good = ["learner", "--connect", "sync-host:7000", "--id", "learner-0", "--token-file", "token"]
    check_command(good)
    with pytest.raises(SystemExit) as stop:
        _parser().parse_args(good[:-2] + ["--tls-crt", "cert.pem"])
    assert stop.value.code == 2
    assert "ddiloco: error: unrecognized arguments: --tls-crt" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="--tls-crt"):
        check_command(good[:-2] + ["--tls-crt", "cert.pem"])
    with pytest.raises(AssertionError, match="no flag --tls"):
        check_command(good + ["--tls", "ca.pem"])  # argparse takes it as --tls-ca


# ---- Slurm ---------------------------------------------------------------------------------

STUB = '#!/bin/bash\nprintf "%s\\0" "${0##*/}" "$@" > "$(mktemp "$STUB_CALLS/call.XXXXXX")"\n'
STUBS = {
    "ddiloco": STUB,
    # torchrun ... --id ID ...: fails (exit 1) when ID is $STUB_FAILING.
    "torchrun": STUB + '[[ -n ${STUB_FAILING:-} && " $* " == *" --id $STUB_FAILING "* ]] && exit 1\nexit 0\n',
    "scancel": STUB,
    # srun [--option[=value] ...] COMMAND...: run COMMAND here.
    "srun": STUB + 'while [[ $# -gt 0 && $1 == -* ]]; do shift; done\nexec "$@"\n',
    # scontrol show hostnames LIST: node0 .. node(N-1); scontrol show node -o NAME: its NodeAddr, NAME.ib
    "scontrol": STUB + 'if [[ $2 == node ]]; then echo "NodeName=$4 Arch=x86_64 NodeAddr=$4.ib NodeHostName=$4"; '
                       'exit; fi\nfor (( i = 0; i < STUB_NODES; i++ )); do echo "node$i"; done\n',
}


def run_sbatch(tmp_path: Path, nodes: int, script: Path = SBATCH, **env: str):
    """Run the batch script under bash with Slurm's commands stubbed; (calls, stdout, stderr, code)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir(exist_ok=True)
    calls.mkdir(exist_ok=True)
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    environment = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "STUB_CALLS": str(calls),
        "STUB_NODES": str(nodes), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": f"node[0-{nodes - 1}]",
        "SLURM_JOB_CPUS_PER_NODE": f"16(x{nodes})", "SLURM_GPUS_ON_NODE": "8", "RUN_DIR": str(tmp_path / "run"), **env,
    }
    done = subprocess.run(["bash", str(script)], env=environment, capture_output=True, text=True, timeout=60)
    recorded = [f.read_text().split("\0")[:-1] for f in sorted(calls.iterdir())]
    return recorded, done.stdout, done.stderr, done.returncode


def slurm_commands(recorded: list[list[str]]) -> list[tuple[dict[str, str], list[str], argparse.Namespace]]:
    """(srun options, ddiloco arguments, parsed) of every srun step; every ddiloco runs in one."""
    steps = []
    for call in recorded:
        if call[0] != "srun":
            continue
        i = next(i for i, token in enumerate(call[1:], 1) if not token.startswith("-"))
        options = dict((opt.split("=", 1) + [""])[:2] for opt in call[1:i])
        argv = ddiloco_argv(call[i:])
        assert argv is not None, f"an srun step that runs no ddiloco: {call}"
        steps.append((options, argv, check_command(argv)))
    launched = [c for c in recorded if c[0] in ("ddiloco", "torchrun")]
    assert len(launched) == len(steps), "ddiloco started outside srun"
    return steps


@pytest.mark.parametrize("case", [
    dict(env={}, learners=2, per_learner=1, shards=1, own_node=1, nodes=3),
    dict(env={"LEARNERS": "3", "NODES_PER_LEARNER": "2", "SYNC_OWN_NODE": "0", "SHARDS": "2", "TOKENS": "1000000",
              "METRICS_PORT": "9100", "TLS_CERT": "/certs/sync.pem", "TLS_KEY": "/certs/sync.key",
              "TLS_CA": "/certs/ca.pem", "CONFIG": "run.toml"},
         learners=3, per_learner=2, shards=2, own_node=0, nodes=6),
    dict(env={"LEARNERS": "5", "NPROC_PER_NODE": "1"}, learners=5, per_learner=1, shards=1, own_node=1, nodes=3),
    dict(env={"LEARNERS": "3", "NPROC_PER_NODE": "2", "SYNC_CPUS": "4"}, learners=3, per_learner=1, shards=1,
         own_node=0, nodes=1),
], ids=["defaults", "sharded-tls-multinode", "learners-share-nodes", "one-node"])
def test_slurm_command_lines_are_accepted_and_consistent(case, tmp_path):
    env = dict(case["env"])
    if "CONFIG" in env:  # the Kubernetes ConfigMap's TOML, as a file on shared storage
        (config_map,) = [d for d in kustomize(KUBERNETES / "base") if d["kind"] == "ConfigMap"]
        env["CONFIG"] = str(tmp_path / "run.toml")
        Path(env["CONFIG"]).write_text(config_map["data"]["run.toml"])
    m, per_learner, shards, own, nodes = (case[k] for k in ("learners", "per_learner", "shards", "own_node", "nodes"))
    recorded, stdout, stderr, code = run_sbatch(tmp_path, nodes, **env)
    assert code == 0, stderr
    assert not [c for c in recorded if c[0] == "scancel"], "the job cancelled itself"
    run_dir = tmp_path / "run"
    token = run_dir / "token"
    assert re.fullmatch(r"[0-9a-f]{64}\n", token.read_text())
    assert stat.S_IMODE(token.stat().st_mode) == 0o600

    steps = slurm_commands(recorded)
    syncs = sorted((s for s in steps if s[2].command == "sync"), key=lambda s: s[2].listen)
    learners = sorted((s for s in steps if s[2].command == "learner"), key=lambda s: s[2].id)
    assert len(syncs) + len(learners) == len(steps)

    # The synchronizer: one process per shard on the first node, each with its own state
    # directory under RUN_DIR, resumed, finishing the job when the run is over.
    addresses = []
    assert len(syncs) == shards
    for s, (options, argv, args) in enumerate(syncs):
        assert options["--nodelist"] == "node0"
        assert args.resume is Resume.IF_PRESENT and args.exit_when_finished
        assert Path(args.state_dir).parent.parent == run_dir
        assert args.token_file == str(token)
        assert int(args.learners) == m
        assert args.shard == (f"{s}/{shards}" if shards > 1 else None)
        assert (args.tls_cert, args.tls_key) == (env.get("TLS_CERT"), env.get("TLS_KEY"))
        addresses.append(f"node0.ib:{args.listen.rsplit(':', 1)[1]}")
        if "CONFIG" in env:
            assert config_from_args(args).run.learners == m
    assert len({args.state_dir for _, _, args in syncs}) == shards

    # Learners learner-0 .. learner-(M-1), each a torchrun job over its own nodes or sharing
    # the learner nodes in turn, connecting to every shard; each rendezvous on its own port
    # of its first node's address, each node's CPUs divided among what runs there.
    assert [args.id for _, _, args in learners] == [f"learner-{i}" for i in range(m)]
    learner_nodes = nodes - own
    groups = []
    for i, (options, argv, args) in enumerate(learners):
        group = options["--nodelist"].split(",")
        first = own + (i * per_learner if per_learner > 1 else i % learner_nodes)
        assert group == [f"node{first + j}" for j in range(per_learner)]
        groups.append(group)
        assert args.connect == ",".join(addresses)
        assert args.token_file == str(token)
        assert args.tls_ca == env.get("TLS_CA")
        sharing = sum(1 for k in range(m) if per_learner == 1 and k % learner_nodes == i % learner_nodes) or 1
        reserved = int(env.get("SYNC_CPUS", "2")) * shards if first == 0 else 0
        cpus = (16 - reserved) // sharing
        assert int(options["--cpus-per-task"]) == cpus
        assert int(args.threads) == cpus // int(env.get("NPROC_PER_NODE", "8"))
        assert args.fsdp == (per_learner > 1)  # a learner over several nodes is one FSDP2 job
    torchruns = sorted((c for c in recorded if c[0] == "torchrun"), key=lambda c: flag(c, "--id"))
    assert [flag(c, "--rdzv_endpoint") for c in torchruns] == [f"{group[0]}.ib:{29500 + i}" for i, group in enumerate(groups)]
    assert all(flag(c, "--nnodes") == str(per_learner) for c in torchruns)
    used = [node for group in groups for node in group]
    assert sorted(set(used)) == [f"node{k}" for k in range(own, nodes)]
    if per_learner > 1:
        assert len(used) == len(set(used)) == m * per_learner

    # The status command it prints is one the CLI takes.
    (line,) = [x for x in stdout.splitlines() if "ddiloco status" in x]
    check_command(shlex.split(line.split("ddiloco ", 1)[1]))


@pytest.mark.parametrize(("nodes", "env", "needle"), [
    (4, {"LEARNERS": "2"}, "more than 2 learners can use: sbatch --nodes=3"),
    (4, {"LEARNERS": "2", "NODES_PER_LEARNER": "2"}, "sbatch --nodes=5"),
    (1, {"LEARNERS": "8", "NPROC_PER_NODE": "2"}, "node0 has 16 CPUs after the synchronizer's 2 for 8 learner(s)"),
], ids=["too-many-nodes", "multinode-learners", "too-few-cpus"])
def test_slurm_script_refuses_an_allocation_that_does_not_fit(tmp_path, nodes, env, needle):
    recorded, _, stderr, code = run_sbatch(tmp_path, nodes=nodes, **env)
    assert code == 2
    assert needle in stderr
    assert not [c for c in recorded if c[0] in ("srun", "ddiloco", "torchrun")]


def test_a_learner_lost_for_good_fails_the_job(tmp_path):
    recorded, _, stderr, code = run_sbatch(tmp_path, nodes=3, STUB_FAILING="learner-1", MAX_RESTARTS="1",
                                           RESTART_DELAY="0")
    assert code == 3, stderr
    assert "learner-1 exited with code 1; restart 1 of 1" in stderr
    assert "lost for good (restarts exhausted): learner-1;" in stderr
    started = [flag(c, "--id") for c in recorded if c[0] == "torchrun"]
    assert sorted(started) == ["learner-0", "learner-1", "learner-1"]


def test_a_broken_slurm_script_is_caught(tmp_path):
    broken = tmp_path / "broken.sbatch"
    broken.write_text(SBATCH.read_text().replace("--state-dir", "--state-directory"))
    recorded, _, stderr, code = run_sbatch(tmp_path, nodes=3, script=broken)
    assert code == 0, stderr  # bash does not know; the checker does
    with pytest.raises(AssertionError, match="--state-directory"):
        slurm_commands(recorded)

