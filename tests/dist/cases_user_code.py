"""Code as users write it, under every layout, against single-process PyTorch.

- the supervised loop `loss_fn(model(x), y)`: a plain classifier with a batch (x, y);
- Hugging Face's `model(**batch)`: input_ids, a padding attention mask and labels with
  -100 at the padding, the model's own loss;
- the loss spellings users write for a causal LM (flatten(0, 1).float(), view, reshape,
  .to(float32), shifted logits, ignore_index, label smoothing, log_softmax + gather, a
  sum divided by a count).

Targets with ignored positions are laid out so that the shards hold different counts
(`uneven_labels`): a step that averaged per-shard means would fail these cases.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autopar
from autopar.examples import Example, hf_tiny, llama
from tests.dist.cases_amp import check_amp_parity
from tests.dist.cases_dp import adamw, check_parity, sgd
from tests.dist.registry import case

STEPS = 3
BATCH, SEQ, VOCAB = 4, 8, 64


# -- the supervised loop: model(x), loss_fn(output, y) ---------------------------------------

class Classifier(torch.nn.Module):
    """A plain classifier whose forward takes the features only."""

    def __init__(self, features=12, width=16, classes=5, blocks=2):
        super().__init__()
        self.embed = torch.nn.Linear(features, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def classifier() -> tuple[Example, torch.Tensor]:
    torch.manual_seed(0)
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    return Example(Classifier(), (x,), lambda out, y: F.cross_entropy(out, y),
                   "classifier"), y


for _name, _layout in {"dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2, microbatches=2),
                       "dp2_zero3": dict(dp=2, zero=3)}.items():
    for _opt in (sgd, adamw):
        def _case(layout=_layout, opt=_opt):
            example, y = classifier()
            check_parity(example, opt, autopar.Layout(**layout), steps=STEPS, targets=(y,))
        _case.__name__ = f"user_loop_classifier_x_y_{_name}_{_opt.__name__}"
        case(world=2)(_case)


# -- Hugging Face's loop: model(**batch) with padding and labels -----------------------------

def padded_batch(seed: int, batch=BATCH, seq=SEQ, vocab=VOCAB) -> dict[str, torch.Tensor]:
    """Right-padded rows of different lengths: the mask is 0 and the label -100 on padding."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    lengths = torch.tensor([seq, seq - 3, seq - 1, 2][:batch])
    mask = (torch.arange(seq) < lengths[:, None]).long()
    ids = ids * mask  # pad id 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def hf_dict_example() -> tuple[Example, list]:
    example = llama(layers=2, hidden=32, heads=4, kv_heads=2, vocab=VOCAB, batch=BATCH, seq=SEQ)
    batch = padded_batch(0)
    flat = [tuple(padded_batch(s).values()) for s in range(1, STEPS + 1)]
    return Example(example.model, batch, None, "llama, dict batch with padding"), flat


for _name, _layout in {"dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2, microbatches=2),
                       "dp2_zero3": dict(dp=2, zero=3)}.items():
    def _hf_case(layout=_layout):
        example, batches = hf_dict_example()
        step = check_parity(example, sgd, autopar.Layout(**layout), batches=batches)
        if layout.get("dp", 1) * layout.get("microbatches", 1) > 1:  # padding: uneven counts
            result = {r.name: r for r in step.pass_results}["global_loss_mean"]
            assert result.stats["normalizers"] >= 1, result.stats
    _hf_case.__name__ = f"user_loop_hf_dict_batch_padding_labels_{_name}_sgd"
    case(world=2)(_hf_case)


# -- loss spellings -------------------------------------------------------------------------

def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _masked_log_likelihood(out, labels):
    logp = torch.log_softmax(_logits(out).float(), dim=-1)
    mask = labels != -100
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * mask).sum() / mask.sum()


# name -> (loss_fn, whether it takes separate labels with ignored positions)
LOSSES = {
    "flatten_float": (lambda out, ids: F.cross_entropy(
        _logits(out).flatten(0, 1).float(), ids.flatten()), False),
    "view": (lambda out, ids: F.cross_entropy(
        _logits(out).view(-1, _logits(out).size(-1)), ids.view(-1)), False),
    "reshape": (lambda out, ids: F.cross_entropy(
        _logits(out).reshape(-1, VOCAB), ids.reshape(-1)), False),
    "to_float32": (lambda out, ids: F.cross_entropy(
        _logits(out).to(torch.float32).flatten(0, 1), ids.flatten()), False),
    "shifted": (lambda out, ids: F.cross_entropy(
        _logits(out)[:, :-1].contiguous().view(-1, VOCAB), ids[:, 1:].contiguous().view(-1)),
        False),
    "ignore_index": (lambda out, labels: F.cross_entropy(
        _logits(out).flatten(0, 1).float(), labels.flatten(), ignore_index=-100), True),
    "label_smoothing": (lambda out, labels: F.cross_entropy(
        _logits(out).flatten(0, 1), labels.flatten(), label_smoothing=0.1), True),
    "log_softmax_gather": (_masked_log_likelihood, True),
    "sum_over_count": (lambda out, labels: F.cross_entropy(
        _logits(out).flatten(0, 1), labels.flatten(), reduction="sum")
        / (labels != -100).sum(), True),
    "model_labels": (None, True),
    # a sum over the batch over a count known in advance (Hugging Face's
    # num_items_in_batch): a sum, so each shard's loss is scaled by the number of shards
    # (global_loss_mean)
    "sum_over_tokens": (lambda out, ids: F.cross_entropy(
        _logits(out).flatten(0, 1), ids.flatten(), reduction="sum") / (BATCH * SEQ), False),
    # divided by the number of sequences the step sees (the shard's, traced as a number):
    # a mean over the batch's sequences of their summed token losses
    "sum_per_sequence": (lambda out, ids: F.cross_entropy(
        _logits(out).flatten(0, 1), ids.flatten(), reduction="sum") / ids.shape[0], False),
}


def uneven_labels(ids: torch.Tensor) -> torch.Tensor:
    """Labels of the ids with -100 on a prefix whose length differs per row (and so per
    data-parallel rank and micro-batch)."""
    labels = ids.clone()
    for row in range(labels.shape[0]):
        labels[row, :(3 * row) % labels.shape[1]] = -100
    return labels


def loss_example(name: str) -> tuple[Example, tuple | None, list]:
    """The example, its targets and flat batches for one loss spelling."""
    loss_fn, has_labels = LOSSES[name]
    example = llama(layers=2, hidden=32, heads=4, kv_heads=2, vocab=VOCAB, batch=BATCH, seq=SEQ)
    gens = [torch.Generator().manual_seed(s) for s in range(1, STEPS + 1)]
    ids = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for g in gens]
    if name == "model_labels":  # model(input_ids=..., labels=...).loss
        batch = {"input_ids": example.batch[0], "labels": uneven_labels(example.batch[0])}
        return (Example(example.model, batch, None, name), None,
                [(i, uneven_labels(i)) for i in ids])
    if has_labels:  # loss_fn(model(ids), labels)
        return (Example(example.model, example.batch, loss_fn, name),
                (uneven_labels(example.batch[0]),), [(i, uneven_labels(i)) for i in ids])
    return Example(example.model, example.batch, loss_fn, name), None, [(i,) for i in ids]


# On batches this small (4 x 8 tokens) a weight gradient sums few terms, and one bf16
# rounding of it is as large as eager autocast's own error against float64 (measured on
# the MLP weights: 3.4-4.3e-6 on a movement of 4-5.6e-4, ~1 eps): two roundings
AMP_ROUNDINGS = 2
SPELLING_LAYOUTS = {"tp2": (2, dict(tp=2)), "dp2_tp2": (4, dict(dp=2, tp=2)),
                    "pp2": (2, dict(pp=2, microbatches=2)), "dp2_zero3": (2, dict(dp=2, zero=3))}

for _loss in LOSSES:
    for _lname, (_world, _layout) in SPELLING_LAYOUTS.items():
        def _spelling_case(loss=_loss, layout=_layout):
            example, targets, batches = loss_example(loss)
            check_parity(example, sgd, autopar.Layout(**layout), targets=targets,
                         batches=batches)
        _spelling_case.__name__ = f"loss_spelling_{_loss}_{_lname}_sgd"
        case(world=_world)(_spelling_case)

    def _amp_case(loss=_loss):
        example, targets, batches = loss_example(loss)
        check_amp_parity(example, "bf16", roundings=AMP_ROUNDINGS, targets=targets,
                         batches=batches, dp=2)
    _amp_case.__name__ = f"loss_spelling_{_loss}_dp2_amp_bf16"
    case(world=2)(_amp_case)


# A loss summed over the batch under AdamW too: its update is near invariant to the
# gradients' scale, so the loss and weights catch a wrong division of the loss by the
# shards only through the epsilon and the loss itself; the layouts split the batch in
# both ways (data-parallel ranks and micro-batches of a rank)
for _lname, (_world, _layout) in {"dp2_mb2": (2, dict(dp=2, microbatches=2)),
                                  "pp2": (2, dict(pp=2, microbatches=2))}.items():
    def _summed_adamw_case(layout=_layout):
        example, targets, batches = loss_example("sum_over_tokens")
        check_parity(example, adamw, autopar.Layout(**layout), targets=targets,
                     batches=batches)
    _summed_adamw_case.__name__ = f"loss_spelling_sum_over_tokens_{_lname}_adamw"
    case(world=_world)(_summed_adamw_case)


# the number of sequences written as a tensor (a constant of the export, read at a second
# batch size), under data parallelism and micro-batches of a pipeline
def _sum_per_sequence_tensor(out, ids):
    return F.cross_entropy(_logits(out).flatten(0, 1), ids.flatten(), reduction="sum") \
        / torch.tensor(ids.shape[0])


for _lname, (_world, _layout) in {"dp2": (2, dict(dp=2)),
                                  "pp2": (2, dict(pp=2, microbatches=2))}.items():
    def _tensor_size_case(layout=_layout):
        example, targets, batches = loss_example("sum_per_sequence")
        example = Example(example.model, example.batch, _sum_per_sequence_tensor,
                          example.description)
        check_parity(example, sgd, autopar.Layout(**layout), targets=targets, batches=batches)
    _tensor_size_case.__name__ = f"loss_spelling_sum_per_sequence_as_a_tensor_{_lname}_sgd"
    case(world=_world)(_tensor_size_case)


# -- the reproductions on a second architecture -------------------------------------

def qwen2_flatten_float():
    example = hf_tiny("qwen2", batch=BATCH, seq=SEQ)
    return Example(example.model, example.batch, LOSSES["flatten_float"][0], "qwen2")


@case(world=2)
def loss_spelling_flatten_float_qwen2_tp2_sgd():
    check_parity(qwen2_flatten_float(), sgd, autopar.Layout(tp=2), steps=STEPS)


@case(world=2)
def loss_spelling_flatten_float_qwen2_tp2_amp_bf16():
    # Qwen2's key biases get no gradient (softmax is shift-invariant) and move by rounding
    # noise alone (2e-5, against 1e-3 for the weights): the noise floor bounds them
    check_amp_parity(qwen2_flatten_float(), "bf16", roundings=2, noise_floor=True, tp=2)
