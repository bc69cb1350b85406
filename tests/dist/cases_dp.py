"""Data-parallel cases (2 processes): parity with single-process PyTorch, checkpoints, errors."""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.distributed as dist

import autopar
from autopar.examples import gpt2, llama, mlp
from autopar.compiler.ir.batch import Objective
from tests.dist.registry import case
from autopar.testing import compare, make_batches, reference_train

STEPS = 5


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def check_parity(example, optimizer, layout, steps=STEPS, cluster=None, targets=None,
                 batches=None, **compile_kw):
    """The compiled step against single-process PyTorch on `steps` batches: the model
    takes example.batch (a tuple or a dict), the loss `targets` (or, without, the
    inputs); `batches` are flat (Objective order), default random ones."""
    objective, flat = Objective.from_example(example.batch, targets, example.loss_fn)
    init = {k: v.clone() for k, v in example.model.state_dict().items()}
    batches = batches or make_batches(flat, steps)
    ref_losses, ref_state = reference_train(example.model, batches, objective, optimizer)
    model = copy.deepcopy(example.model)
    cluster = cluster or autopar.ClusterSpec.local(dist.get_world_size())
    step = autopar.compile(model, cluster,
                           example_inputs=example.batch, example_targets=targets,
                           loss_fn=example.loss_fn, optimizer=optimizer, layout=layout,
                           **compile_kw)
    losses = []
    for b in batches:  # called as the user's loop calls it: step(x, y), step(**batch)
        args, kwargs = objective.unflatten(b)
        losses.append(step(*args, **kwargs).item())
    report = compare(losses, ref_losses, step.full_state_dict(), ref_state, init,
                     adam=optimizer.__name__.startswith("adam"))
    assert len(set(round(x, 12) for x in losses)) == len(losses), "the loss did not change"
    assert report.ok, str(report)
    return step


for _name, _factory in {"gpt2": gpt2, "llama": llama, "mlp": mlp}.items():
    for _opt in (adamw, sgd):
        def _case(factory=_factory, opt=_opt):
            check_parity(factory(), opt, autopar.Layout(dp=2))
        _case.__name__ = f"dp2_parity_{_name}_{_opt.__name__}"
        case(world=2)(_case)


def _check_gathered_embeddings(factory, optimizer, expected):
    step = check_parity(factory(vocab=1024), optimizer, autopar.Layout(dp=2))
    result = {r.name: r for r in step.pass_results}["insert_allreduce"]
    assert result.stats["embedding_grads_gathered"] == expected, result.stats


@case(world=2)
def dp2_parity_gpt2_tied_embedding_rows_gathered_sgd():
    _check_gathered_embeddings(gpt2, sgd, ["transformer.wte.weight"])


@case(world=2)
def dp2_parity_gpt2_tied_embedding_rows_gathered_adamw():
    _check_gathered_embeddings(gpt2, adamw, ["transformer.wte.weight"])


@case(world=2)
def dp2_parity_llama_embedding_rows_gathered_sgd():
    _check_gathered_embeddings(llama, sgd, ["model.embed_tokens.weight"])


class TiedPaddedLM(torch.nn.Module):
    """A plain module with a padded embedding tied to its output head."""

    def __init__(self, vocab=512, width=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width, padding_idx=0)
        self.mix = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def tied_padded_lm():
    from autopar.examples import Example, causal_lm_loss

    torch.manual_seed(0)
    ids = torch.randint(0, 512, (8, 12))
    ids[:, -3:] = 0  # padding tokens: their embedding row gets no gradient
    return Example(TiedPaddedLM(), (ids,), causal_lm_loss, "tied, padded")


@case(world=2)
def dp2_parity_tied_padded_embedding_rows_gathered_sgd():
    example = tied_padded_lm()
    step = check_parity(example, sgd, autopar.Layout(dp=2))
    result = {r.name: r for r in step.pass_results}["insert_allreduce"]
    assert result.stats["embedding_grads_gathered"] == ["embed.weight"]


for _arch in ("qwen2", "mixtral", "gpt_neox", "bert", "falcon"):
    def _arch_case(model_type=_arch):
        from autopar.examples import hf_tiny
        check_parity(hf_tiny(model_type), sgd, autopar.Layout(dp=2))
    _arch_case.__name__ = f"dp2_parity_{_arch}_sgd"
    case(world=2)(_arch_case)


@case(world=2)
def dp2_parity_one_bucket_per_grad_sgd():
    check_parity(gpt2(), sgd, autopar.Layout(dp=2, bucket_mb=0))


@case(world=2)
def dp2_parity_without_overlap_sgd():
    check_parity(llama(), sgd, autopar.Layout(dp=2, bucket_mb=0.01, overlap_comm=False))


@case(world=2)
def dp2_checkpoint_resume_equals_uninterrupted():
    example = mlp()
    batches = make_batches(example.batch, 4)
    a = autopar.compile(copy.deepcopy(example.model), None, example.batch, example.loss_fn,
                        optimizer=adamw, layout=autopar.Layout(dp=2))
    for b in batches[:2]:
        a(*b)
    root = tempfile.mkdtemp(prefix="autopar-dp2-") if dist.get_rank() == 0 else None
    path_list = [f"{root}/ckpt"]
    dist.broadcast_object_list(path_list)  # rank 0's directory, seen by every rank
    a.save(path_list[0])
    for b in batches[2:]:
        a(*b)
    torch.manual_seed(99)  # a different start: load must overwrite it
    other = mlp(seed=7)
    b_step = autopar.compile(other.model, None, example.batch, example.loss_fn,
                             optimizer=adamw, layout=autopar.Layout(dp=2))
    b_step.load(path_list[0])
    for b in batches[2:]:
        b_step(*b)
    sa, sb = a.full_state_dict(), b_step.full_state_dict()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@case(world=2)
def dp2_wrong_world_size_is_refused():
    example = mlp()
    try:
        autopar.compile(example.model, None, example.batch, example.loss_fn,
                        layout=autopar.Layout(dp=4))
    except autopar.LayoutError as exc:
        assert "torchrun --nproc-per-node 4" in str(exc), exc
        assert "world size is 2" in str(exc), exc
    else:
        raise AssertionError("dp=4 on 2 processes was accepted")


@case(world=2)
def dp2_full_state_dict_has_every_original_name():
    example = gpt2()
    step = autopar.compile(copy.deepcopy(example.model), None, example.batch, example.loss_fn,
                           layout=autopar.Layout(dp=2))
    assert set(step.full_state_dict()) == set(example.model.state_dict()), \
        set(example.model.state_dict()) ^ set(step.full_state_dict())




@case(world=2)
def planned_layout_parity_gpt2_sgd():
    """compile(layout=None) plans on this job's cluster: every rank picks the layout
    autopar.plan picks, and it trains as single-process PyTorch does."""
    example = gpt2()
    cluster = autopar.ClusterSpec.local(2)
    expected = autopar.plan(example.model, cluster, example.batch, example.loss_fn,
                            optimizer="sgd-momentum")
    step = check_parity(example, sgd, None, cluster=cluster)
    assert step.plan is not None and step.plan.layout == expected.layout
    layouts = [None, None]
    dist.all_gather_object(layouts, step.plan.layout)
    assert layouts[0] == layouts[1]
