"""Kubernetes: a Kubeflow PyTorchJob (kubeflow.org/v1) that runs `autopar.elastic`, its
offline validation, and EDL's auto-scaler as a pure function.

The manifest is built from the Kubeflow training operator's own Python SDK models
(`kubeflow-training`) and the `kubernetes` client's, serialised by the client's
ApiClient. The training operator runs the command under its elastic policy by setting
torchrun's PET_* variables (nnodes MIN:MAX, nproc per node, the rendezvous backend, max
restarts; the backend is autopar's `autopar-c10d`, torch's c10d with a fix that lets a
replacement pod join, see `autopar.runtime.rendezvous`), so the container runs
`python -m torch.distributed.run -m autopar.elastic` with no launcher flags of its own.

`validate(manifest)` checks, with no cluster:
- the CRD's OpenAPI v3 schema, vendored as `autopar/data/kubeflow.org_pytorchjobs.v1.9.0.yaml`
  (manifests/base/crds/kubeflow.org_pytorchjobs.yaml of kubeflow/training-operator at
  tag v1.9.0, Apache-2.0);
- unknown fields, strictly: the CRD admits them (a field the operator ignores is a
  misspelling the user never hears of), so every field must be one the schema names,
  except inside `x-kubernetes-preserve-unknown-fields` objects;
- the operator's admission webhook for PyTorchJob (v1.9.0): a DNS-1035 name, only Master
  and Worker replicas, a Master of exactly 1 replica, Workers of at least 1, a container
  named "pytorch" with an image in each, a Worker whenever there is an elastic policy,
  not both elasticPolicy.nProcPerNode and nprocPerNode;
- and what autopar needs: minReplicas <= replicas <= maxReplicas, where replicas counts
  the Master and the Workers (each pod is one torchrun node), and nprocPerNode no more
  than the GPUs the pod asks for.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.cluster import ClusterSpec
from autopar.layout import Layout
from autopar.runtime.rendezvous import BACKEND as RENDEZVOUS

CRD_FILE = Path(__file__).parent / "data" / "kubeflow.org_pytorchjobs.v1.9.0.yaml"
CRD_SOURCE = ("kubeflow/training-operator v1.9.0, "
              "manifests/base/crds/kubeflow.org_pytorchjobs.yaml")
CONTAINER = "pytorch"  # the operator's default container name (its webhook requires one)
GPU_RESOURCE = "nvidia.com/gpu"
TOKEN_SECRET_KEY = "token"


class ManifestError(ValueError):
    """A manifest that a cluster would reject or misread; lists every problem by field."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("the PyTorchJob manifest is not valid:\n  " + "\n  ".join(problems))


@dataclass
class JobSpec:
    """What an elastic autopar job on Kubernetes is made of."""

    name: str
    image: str
    model: str
    layout: Layout
    cluster: ClusterSpec
    min_nodes: int = 1
    max_nodes: int | None = None  # default: cluster.nodes
    max_restarts: int = 3
    checkpoint_claim: str = "autopar-checkpoints"  # a PersistentVolumeClaim every pod mounts
    checkpoint_path: str = "/checkpoints"
    checkpoint_every: int = 100
    blocks: int = 1024
    epochs: int = 1
    token_secret: str = "autopar-job-token"  # a Secret whose key "token" is the job's token
    # PassOptions fields the workers compile the layout with (a Plan's pass_options)
    pass_options: dict = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)

    @property
    def nodes(self) -> int:
        return self.cluster.nodes

    @property
    def nproc_per_node(self) -> int:
        return self.cluster.devices_per_node


# -- the manifest ---------------------------------------------------------------------------

def pytorch_job(spec: JobSpec):
    """The PyTorchJob as the SDK's model objects."""
    from kubeflow.training import models as kf
    from kubernetes import client as k8s

    max_nodes = spec.max_nodes or spec.nodes
    command = ["python", "-m", "torch.distributed.run", "-m", "autopar.elastic", spec.model,
               "--layout", json.dumps(spec.layout.non_default_fields()),
               "--checkpoint-dir", spec.checkpoint_path,
               "--checkpoint-every", str(spec.checkpoint_every),
               "--blocks", str(spec.blocks), "--epochs", str(spec.epochs),
               *(["--pass-options", json.dumps(spec.pass_options)] if spec.pass_options else []),
               *spec.extra_args]
    gpus = spec.nproc_per_node if spec.cluster.backend == "nccl" else 0
    resources = k8s.V1ResourceRequirements(limits={GPU_RESOURCE: str(gpus)}) if gpus else None
    container = k8s.V1Container(
        name=CONTAINER, image=spec.image, command=command, resources=resources,
        env=[k8s.V1EnvVar(name="AUTOPAR_JOB_TOKEN", value_from=k8s.V1EnvVarSource(
            secret_key_ref=k8s.V1SecretKeySelector(name=spec.token_secret,
                                                   key=TOKEN_SECRET_KEY)))],
        volume_mounts=[k8s.V1VolumeMount(name="checkpoints", mount_path=spec.checkpoint_path)])
    template = k8s.V1PodTemplateSpec(spec=k8s.V1PodSpec(
        containers=[container],
        volumes=[k8s.V1Volume(name="checkpoints", persistent_volume_claim=(
            k8s.V1PersistentVolumeClaimVolumeSource(claim_name=spec.checkpoint_claim)))]))
    # each pod is one torchrun node; the elastic policy needs Workers, and the Master is
    # the first node when there are several
    replicas = {"Worker": kf.KubeflowOrgV1ReplicaSpec(
        replicas=max(1, spec.nodes - 1), restart_policy="OnFailure", template=template)}
    if spec.nodes > 1:
        replicas["Master"] = kf.KubeflowOrgV1ReplicaSpec(replicas=1, restart_policy="OnFailure",
                                                         template=template)
    return kf.KubeflowOrgV1PyTorchJob(
        api_version="kubeflow.org/v1", kind="PyTorchJob",
        metadata=k8s.V1ObjectMeta(name=spec.name, labels={"app.kubernetes.io/created-by": "autopar"}),
        spec=kf.KubeflowOrgV1PyTorchJobSpec(
            nproc_per_node=str(spec.nproc_per_node),
            elastic_policy=kf.KubeflowOrgV1ElasticPolicy(
                min_replicas=spec.min_nodes, max_replicas=max_nodes, rdzv_backend=RENDEZVOUS,
                max_restarts=spec.max_restarts),
            pytorch_replica_specs=replicas,
            run_policy=kf.KubeflowOrgV1RunPolicy(clean_pod_policy="None")))


def manifest(spec: JobSpec) -> dict:
    """The PyTorchJob as the JSON/YAML a cluster takes, validated (ManifestError if not)."""
    from kubernetes.client import ApiClient

    out = ApiClient().sanitize_for_serialization(pytorch_job(spec))
    problems = validate(out)
    if problems:
        raise ManifestError(problems)
    return out


# -- validation -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def crd_schema() -> dict:
    """The CRD's OpenAPI v3 schema of version v1 (from the vendored file)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(CRD_FILE.read_text(), Loader=loader)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def validate(manifest: dict) -> list[str]:
    """Every problem of `manifest` (see the module docstring), each naming its field."""
    import jsonschema

    schema = crd_schema()
    validator = jsonschema.Draft7Validator(_for_jsonschema(schema))
    problems = [f"{_path(e.absolute_path)}: {e.message}"
                for e in sorted(validator.iter_errors(manifest), key=lambda e: list(e.absolute_path))]
    problems += _unknown_fields(manifest, schema, "")
    problems += _webhook(manifest)
    return problems


def _for_jsonschema(schema: Any) -> Any:
    """OpenAPI's int-or-string, as JSON Schema understands it; the x- extensions dropped."""
    if isinstance(schema, list):
        return [_for_jsonschema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _for_jsonschema(v) for k, v in schema.items() if not k.startswith("x-kubernetes")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def _path(parts) -> str:
    return ".".join(str(p) for p in parts) or "(the manifest)"


def _unknown_fields(value: Any, schema: dict, where: str) -> list[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out = []
    if isinstance(value, dict):
        known = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            here = f"{where}.{key}" if where else key
            if known is not None and key in known:
                out += _unknown_fields(item, known[key], here)
            elif isinstance(extra, dict):
                out += _unknown_fields(item, extra, here)
            elif known is not None:
                near = _near(key, known)
                out.append(f"{here}: unknown field" + (f" (did you mean {near}?)" if near else ""))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += _unknown_fields(item, schema["items"], f"{where}[{i}]")
    return out


def _near(key: str, known: dict) -> str | None:
    import difflib

    found = difflib.get_close_matches(key, list(known), n=1)
    return found[0] if found else None


_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def _webhook(manifest: dict) -> list[str]:
    """The training operator's PyTorchJob admission rules (v1.9.0), and autopar's."""
    out = []
    name = manifest.get("metadata", {}).get("name", "")
    if not _DNS1035.match(name or ""):
        out.append(f"metadata.name: {name!r} must be a DNS-1035 label (lower case letters, "
                   f"digits and '-', starting with a letter, at most 63 characters)")
    spec = manifest.get("spec", {})
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if not replicas:
        out.append("spec.pytorchReplicaSpecs: must be given")
    for role, rspec in replicas.items():
        where = f"spec.pytorchReplicaSpecs.{role}"
        if role not in ("Master", "Worker"):
            out.append(f"{where}: unsupported replica type {role!r} (Master or Worker)")
        count = _int((rspec or {}).get("replicas"))  # a wrong type: the schema says so
        if role == "Master" and count != 1:
            out.append(f"{where}.replicas: must be 1, got {count}")
        if role == "Worker" and count is not None and count < 1:
            out.append(f"{where}.replicas: must be at least 1, got {count}")
        containers = (((rspec or {}).get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers:
            out.append(f"{where}.template.spec.containers: must be given")
        for i, c in enumerate(containers):
            if not c.get("image"):
                out.append(f"{where}.template.spec.containers[{i}].image: must be given")
        if containers and not any(c.get("name") == CONTAINER for c in containers):
            out.append(f"{where}.template.spec.containers: needs a container named {CONTAINER!r}")
        nproc = spec.get("nprocPerNode")
        for i, c in enumerate(containers):
            gpus = ((c.get("resources") or {}).get("limits") or {}).get(GPU_RESOURCE)
            if gpus is not None and nproc is not None and str(nproc).isdigit() and \
                    int(nproc) > int(gpus):
                out.append(f"spec.nprocPerNode: {nproc} processes per node, but "
                           f"{where}.template.spec.containers[{i}] asks for {gpus} GPUs; "
                           f"ask for {nproc} or run {gpus} per node")
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if "Worker" not in replicas:
            out.append("spec.pytorchReplicaSpecs.Worker: must be configured if elastic policy "
                       "is used")
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            out.append("spec.elasticPolicy.nProcPerNode: must not be used with spec.nprocPerNode")
        total = sum(_int((r or {}).get("replicas")) or 0 for r in replicas.values())
        low, high = _int(elastic.get("minReplicas")), _int(elastic.get("maxReplicas"))
        if low is not None and high is not None and low > high:
            out.append(f"spec.elasticPolicy: minReplicas {low} > maxReplicas {high}")
        if low is not None and total < low or high is not None and total > high:
            out.append(f"spec.pytorchReplicaSpecs: {total} nodes (Master + Workers) outside "
                       f"elasticPolicy minReplicas..maxReplicas = {low}..{high}")
    return out


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# -- EDL's auto-scaler ----------------------------------------------------------------------

@dataclass(frozen=True)
class ElasticJob:
    name: str
    min_replicas: int
    max_replicas: int
    replicas: int  # now
    gpus_per_replica: int = 1


def autoscale(jobs: list[ElasticJob], free_gpus: int, load: float,
              load_threshold: float = 0.9) -> dict[str, int]:
    """New replica counts of the elastic jobs (a pure function; EDL's auto-scaler).

    `free_gpus`: GPUs no pod holds; `load`: the cluster's GPU load (0..1). Every job is
    first brought within its min/max. While the load is over `load_threshold`, the
    most-fulfilled job (replicas / max) above its min gives back a replica; otherwise,
    while GPUs are free, the least-fulfilled job below its max gets one. Ties go by
    name, so the result depends only on the inputs."""
    counts = {j.name: min(max(j.replicas, j.min_replicas), j.max_replicas) for j in jobs}
    by_name = {j.name: j for j in jobs}
    free = free_gpus - sum((counts[j.name] - j.replicas) * j.gpus_per_replica for j in jobs)

    def fulfilled(name: str) -> float:
        return counts[name] / by_name[name].max_replicas

    if load > load_threshold:
        shrinkable = [n for n in counts if counts[n] > by_name[n].min_replicas]
        if shrinkable:
            victim = max(shrinkable, key=lambda n: (fulfilled(n), n))
            counts[victim] -= 1
        return counts
    while True:
        growable = [n for n in counts if counts[n] < by_name[n].max_replicas
                    and by_name[n].gpus_per_replica <= free]
        if not growable:
            return counts
        chosen = min(growable, key=lambda n: (fulfilled(n), n))
        counts[chosen] += 1
        free -= by_name[chosen].gpus_per_replica
