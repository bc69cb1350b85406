"""Kubernetes (autopar/k8s.py): the PyTorchJob manifest, its offline validation against the
vendored CRD schema and the operator's webhook rules, and the auto-scaler. No cluster is
reached: what a cluster would do with the manifest is not tested here."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.cluster import ClusterSpec
from autopar.k8s import (
    ElasticJob,
    JobSpec,
    ManifestError,
    autoscale,
    manifest,
    validate,
)


def _spec(**kw) -> JobSpec:
    base = dict(name="gpt2-elastic", image="ghcr.io/me/autopar:0.1", model="gpt2-tiny",
                layout=autopar.Layout(dp=16), cluster=ClusterSpec.preset("dgx-a100-80gb", nodes=2),
                min_nodes=1, max_nodes=4)
    return JobSpec(**{**base, **kw})


def test_the_manifest_runs_autopar_elastic_under_the_operators_elastic_policy():
    m = manifest(_spec())
    assert validate(m) == []
    spec = m["spec"]
    assert (m["apiVersion"], m["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert spec["elasticPolicy"] == {"minReplicas": 1, "maxReplicas": 4,
                                     "rdzvBackend": "autopar-c10d", "maxRestarts": 3}
    assert spec["nprocPerNode"] == "8"
    replicas = spec["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in replicas.items()} == {"Master": 1, "Worker": 1}
    pod = replicas["Worker"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["name"] == "pytorch" and container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    cmd = container["command"]
    assert cmd[:5] == ["python", "-m", "torch.distributed.run", "-m", "autopar.elastic"]
    assert json.loads(cmd[cmd.index("--layout") + 1]) == {"dp": 16}
    assert cmd[cmd.index("--checkpoint-dir") + 1] == container["volumeMounts"][0]["mountPath"]
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "autopar-checkpoints"}
    token = container["env"][0]
    assert token["name"] == "AUTOPAR_JOB_TOKEN" and "secretKeyRef" in token["valueFrom"]


def test_a_misspelled_field_is_named_with_what_was_meant():
    m = manifest(_spec())
    bad = copy.deepcopy(m)
    bad["spec"]["elasticPolicy"]["maxReplica"] = 4
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["imag"] = "x"
    problems = validate(bad)
    assert "spec.elasticPolicy.maxReplica: unknown field (did you mean maxReplicas?)" in problems
    assert any(p.startswith("spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].imag: "
                            "unknown field (did you mean image") for p in problems)


def test_the_crd_schema_catches_a_wrong_type_by_its_path():
    bad = manifest(_spec())
    bad["spec"]["elasticPolicy"]["minReplicas"] = "one"
    assert any(p.startswith("spec.elasticPolicy.minReplicas: 'one' is not of type 'integer'")
               for p in validate(bad))


def test_more_processes_per_node_than_gpus_names_both_counts():
    bad = manifest(_spec())
    bad["spec"]["nprocPerNode"] = "16"
    assert ("spec.nprocPerNode: 16 processes per node, but spec.pytorchReplicaSpecs.Worker"
            ".template.spec.containers[0] asks for 8 GPUs; ask for 16 or run 8 per node"
            ) in validate(bad)


def test_the_operators_webhook_rules():
    m = manifest(_spec())
    bad = copy.deepcopy(m)
    bad["metadata"]["name"] = "GPT2_job"
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "main"
    problems = validate(bad)
    assert any(p.startswith("metadata.name: 'GPT2_job' must be a DNS-1035 label") for p in problems)
    assert "spec.pytorchReplicaSpecs.Master.replicas: must be 1, got 2" in problems
    assert ("spec.pytorchReplicaSpecs.Worker.template.spec.containers: needs a container named "
            "'pytorch'") in problems
    no_worker = copy.deepcopy(m)
    del no_worker["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert ("spec.pytorchReplicaSpecs.Worker: must be configured if elastic policy is used"
            in validate(no_worker))
    with pytest.raises(ManifestError, match=r"2 nodes \(Master \+ Workers\) outside elasticPolicy "
                                            r"minReplicas..maxReplicas = 3..4"):
        manifest(_spec(min_nodes=3))


def test_one_node_is_one_worker():
    m = manifest(_spec(cluster=ClusterSpec.preset("dgx-a100-80gb", nodes=1), layout=autopar.Layout(dp=8)))
    assert {k: v["replicas"] for k, v in m["spec"]["pytorchReplicaSpecs"].items()} == {"Worker": 1}


def test_the_autoscaler_fills_the_least_fulfilled_job_first_and_shrinks_the_most_fulfilled():
    jobs = [ElasticJob("a", 1, 4, 1), ElasticJob("b", 1, 2, 2), ElasticJob("c", 2, 8, 1)]
    # c below its min is brought to it first (1 GPU), then a and c (least fulfilled) grow
    assert autoscale(jobs, free_gpus=4, load=0.2) == {"a": 2, "b": 2, "c": 4}
    # over the load threshold: the most fulfilled job above its min gives one back
    assert autoscale(jobs, free_gpus=0, load=0.95) == {"a": 1, "b": 1, "c": 2}
    assert autoscale([ElasticJob("a", 2, 2, 2)], free_gpus=0, load=0.99) == {"a": 2}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 6), st.integers(0, 8),
                          st.integers(1, 4)), min_size=1, max_size=5),
       st.integers(0, 32), st.floats(0, 1))
def test_the_autoscaler_keeps_every_job_within_its_bounds_and_the_free_gpus(raw, free, load):
    jobs = [ElasticJob(f"j{i}", lo, lo + span, now, gpus)
            for i, (lo, span, now, gpus) in enumerate(raw)]
    out = autoscale(jobs, free, load)
    assert out == autoscale(list(reversed(jobs)), free, load)  # order of the list: no matter
    for j in jobs:
        assert j.min_replicas <= out[j.name] <= j.max_replicas
    grown = sum((out[j.name] - max(j.replicas, j.min_replicas)) * j.gpus_per_replica
                for j in jobs if out[j.name] > max(j.replicas, j.min_replicas))
    clamped = sum((min(max(j.replicas, j.min_replicas), j.max_replicas) - j.replicas)
                  * j.gpus_per_replica for j in jobs)
    assert grown <= max(0, free - clamped)


def test_a_plans_pass_options_reach_the_elastic_workers(tmp_path):
    """A Plan costed with pass options (a pipeline from a template: cuts between blocks)
    runs with them: `k8s job --plan` puts them on autopar.elastic's command line, which
    takes them (and refuses a malformed one by its flag)."""
    from autopar.elastic import build_parser, check_pass_options

    plan = {"layout": {"dp": 8, "pp": 2, "microbatches": 4},
            "pass_options": {"cut_inside_blocks": False}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    made = subprocess.run([sys.executable, "-m", "autopar", "k8s", "job", "gpt2-tiny", "--image",
                           "img:1", "--name", "gpt", "--cluster", "dgx-a100-80gb", "--nodes",
                           "2", "--plan", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert made.returncode == 0, made.stderr
    worker = yaml.safe_load(made.stdout)["spec"]["pytorchReplicaSpecs"]["Worker"]
    command = worker["template"]["spec"]["containers"][0]["command"]
    args = build_parser().parse_args(command[command.index("autopar.elastic") + 1:])
    assert json.loads(args.pass_options) == {"cut_inside_blocks": False}
    assert json.loads(args.layout) == plan["layout"]
    check_pass_options(args.pass_options)
    assert "--pass-options" not in manifest(_spec())["spec"]["pytorchReplicaSpecs"]["Worker"][
        "template"]["spec"]["containers"][0]["command"]
    path.write_text(json.dumps({**plan, "pass_options": {"cut_inside": False}}))
    refused = subprocess.run([sys.executable, "-m", "autopar", "k8s", "job", "gpt2-tiny",
                              "--image", "img:1", "--name", "gpt", "--cluster", "dgx-a100-80gb",
                              "--nodes", "2", "--plan", str(path)], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0 and "pass_options: unknown pass option(s) ['cut_inside']" \
        in refused.stderr, refused.stderr
    for bad, said in [('{"cut_inside_blocks": "no"}', "cut_inside_blocks must be True or False"),
                      ('{"cut_inside": false}', "unknown pass option"), ("[1]", "JSON object")]:
        with pytest.raises(SystemExit, match=f"--pass-options: .*{said}"):
            check_pass_options(bad)


def test_the_cli_writes_a_valid_manifest_and_validates_a_broken_one(tmp_path):
    out = tmp_path / "job.yaml"
    run = lambda *a: subprocess.run([sys.executable, "-m", "autopar", "k8s", *a],
                                    capture_output=True, text=True, timeout=120)
    made = run("job", "llama-tiny", "--image", "img:1", "--name", "llama", "--cluster",
               "dgx-h100", "--nodes", "2", "--max-nodes", "3", "--tp", "8", "-o", str(out))
    assert made.returncode == 0, made.stderr
    m = yaml.safe_load(out.read_text())
    command = m["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert json.loads(command[command.index("--layout") + 1]) == {"dp": 2, "tp": 8}
    assert run("validate", str(out)).returncode == 0
    m["spec"]["runPolicy"]["backoffLimit"] = "three"
    m["spec"]["elasticPolicy"]["rdzvBackends"] = "c10d"
    out.write_text(yaml.safe_dump(m))
    checked = run("validate", str(out))
    assert checked.returncode == 1
    said = " ".join(checked.stdout.split())
    assert "spec.runPolicy.backoffLimit: 'three' is not of type 'integer'" in said
    assert "spec.elasticPolicy.rdzvBackends: unknown field (did you mean rdzvBackend?)" in said
    scale = run("scale", "--jobs", json.dumps([{"name": "a", "min_replicas": 1, "max_replicas": 3,
                                                 "replicas": 1}]),
                "--free-gpus", "1", "--load", "0.1", "--dry-run")
    assert scale.returncode == 0 and "a: 1 -> 2 replicas" in scale.stdout
