"""How one batch reaches the model and the loss: the step's calling convention.

A batch is what the user's loop holds. Part of it goes to the model (`example_inputs`:
a tuple of tensors, one tensor, or a dict of tensors passed as keywords), part only to
the loss (`example_targets`, likewise). The step is called as the model would be,
with the targets after the inputs:

    loss_fn(model(x), y)          example_inputs=(x,), example_targets=(y,)  step(x, y)
    model(**batch).loss           example_inputs=batch (a dict)              step(**batch)
    loss_fn(model(**b), labels)   example_inputs=b, example_targets=(labels,) step(labels, **b)
    loss_fn(model(ids), ids)      example_inputs=(ids,)                       step(ids)

Without targets the loss takes the inputs (`loss_fn(output, *inputs, **inputs_dict)`),
as a causal LM's loss reads its own input ids. Without a loss_fn the loss is the
model's output (a scalar) or its `.loss` (Hugging Face models given `labels=`).

The traced graph takes the batch flat, in one order: the model's positional inputs, its
keyword inputs (in the example's order), then the targets likewise. An `Objective`
holds that order and the loss function; tracing, the planner and the reference
training of autopar.testing all compute the loss through `Objective.loss`, so they
cannot disagree on the convention.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

LossFn = Callable[..., torch.Tensor]
# one part of a batch as the user holds it: tensors by position, one tensor, or by name
Batch = Union[Sequence[torch.Tensor], torch.Tensor, Mapping[str, torch.Tensor]]


class BatchError(ValueError):
    """A batch that does not fit the model, the loss or the compiled step; the message
    says which part and how to pass it."""


def _parts(value: Any, what: str) -> tuple[int, tuple[str, ...], list[Any]]:
    """(positional count, keyword names, tensors in flat order) of one part of a batch."""
    if value is None:
        return 0, (), []
    if isinstance(value, torch.Tensor):
        return 1, (), [value]
    if isinstance(value, Mapping):
        keys = tuple(value)
        bad = [k for k in keys if not isinstance(k, str)]
        if bad:
            raise BatchError(f"{what}: dict keys must be argument names (str), got {bad}")
        return 0, keys, [value[k] for k in keys]
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return len(value), (), list(value)
    raise BatchError(f"{what} must be a tensor, a tuple of tensors or a dict of tensors, "
                     f"got {type(value).__name__}")


@dataclass(frozen=True)
class Objective:
    """The loss of one step on a flat batch: which tensors go to the model, which to the
    loss function (see the module docstring)."""

    loss_fn: LossFn | None
    positional: int
    keywords: tuple[str, ...] = ()
    target_positional: int = 0
    target_keywords: tuple[str, ...] = ()
    has_targets: bool = False

    @classmethod
    def from_example(cls, inputs: Any, targets: Any = None, loss_fn: LossFn | None = None,
                     ) -> tuple[Objective, tuple[torch.Tensor, ...]]:
        """The objective of a batch as the user holds it, and the batch flat. `loss_fn`
        may already be an Objective (a flat batch passed on by autopar itself)."""
        if isinstance(loss_fn, Objective):
            flat = tuple(inputs)
            if targets is not None or len(flat) != loss_fn.size:
                raise BatchError(f"a flat batch of {len(flat)} tensors for an objective of "
                                 f"{loss_fn.size}")
            return loss_fn, flat
        n, keys, flat = _parts(inputs, "example_inputs")
        tn, tkeys, tflat = _parts(targets, "example_targets")
        clash = set(keys) & set(tkeys)
        if clash:
            raise BatchError(f"example_inputs and example_targets both name {sorted(clash)}: "
                             "the step takes them as keywords, so the names must differ")
        if targets is not None and loss_fn is None:
            raise BatchError("example_targets go only to the loss function, and no loss_fn "
                             "was given: pass loss_fn=lambda output, *targets: ...")
        everything = flat + tflat
        bad = [type(x).__name__ for x in everything if not isinstance(x, torch.Tensor)]
        if bad:
            raise BatchError(f"every part of the batch must be a tensor (got {bad}); bind "
                             "other arguments inside loss_fn or a wrapper module")
        return cls(loss_fn, n, keys, tn, tkeys, targets is not None), tuple(everything)

    @property
    def size(self) -> int:
        return self.positional + len(self.keywords) + self.target_positional + len(
            self.target_keywords)

    # -- the two directions between the user's call and the flat batch --------------------

    def flatten(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
        """The flat batch of a step call `step(*args, **kwargs)`."""
        want_pos = self.positional + self.target_positional
        want_kw = set(self.keywords) | set(self.target_keywords)
        if len(args) != want_pos or set(kwargs) != want_kw:
            raise BatchError(f"the step was compiled to be called as {self.call_form()}, "
                             f"got step({_show_call(args, kwargs)})")
        return (*args[:self.positional], *(kwargs[k] for k in self.keywords),
                *args[self.positional:], *(kwargs[k] for k in self.target_keywords))

    def unflatten(self, flat: Sequence[Any]) -> tuple[tuple, dict]:
        """(args, kwargs) of the step call whose flat batch is `flat`."""
        model_args, model_kwargs, target_args, target_kwargs = self._split(flat)
        return (*model_args, *target_args), {**model_kwargs, **target_kwargs}

    def _split(self, flat: Sequence[Any]) -> tuple[tuple, dict, tuple, dict]:
        i = self.positional
        j = i + len(self.keywords)
        k = j + self.target_positional
        return (tuple(flat[:i]), dict(zip(self.keywords, flat[i:j])), tuple(flat[j:k]),
                dict(zip(self.target_keywords, flat[k:])))

    # -- the loss --------------------------------------------------------------------------

    def loss(self, model: torch.nn.Module, flat: Sequence[Any]) -> torch.Tensor:
        """The scalar loss of `model` on the flat batch."""
        model_args, model_kwargs, target_args, target_kwargs = self._split(flat)
        out = model(*model_args, **model_kwargs)
        if self.loss_fn is None:
            if isinstance(out, torch.Tensor):
                return _check_scalar(out, "the model's output", hint=True)
            if getattr(out, "loss", None) is not None:
                return _check_scalar(out.loss, "the model's output.loss", hint=True)
            raise BatchError(
                f"the model returned {type(out).__name__} with no .loss; pass "
                "loss_fn=lambda output, *targets: ... to autopar (or make the model return "
                "a scalar loss; Hugging Face models compute .loss when given labels)")
        if self.has_targets:
            loss = self.loss_fn(out, *target_args, **target_kwargs)
        else:
            loss = self.loss_fn(out, *model_args, **model_kwargs)
        return _check_scalar(loss, f"loss_fn(output, {self._loss_args()})", hint=False)

    # -- checks before tracing -------------------------------------------------------------

    def check_signatures(self, model: torch.nn.Module) -> None:
        """The model's forward and the loss function can take their parts of the batch;
        else a BatchError naming the signature and the way to pass the batch."""
        forward = inspect.signature(model.forward)
        try:
            forward.bind(*range(self.positional), **{k: None for k in self.keywords})
        except TypeError as exc:
            name = f"{type(model).__name__}.forward{forward}"
            raise BatchError(f"{name} cannot take {self._model_args()}: {exc}."
                             f"{self._forward_hint(forward)}") from None
        if self.loss_fn is None:
            return
        try:
            signature = inspect.signature(self.loss_fn)
        except (TypeError, ValueError):  # a builtin without a readable signature
            return
        n, keys = ((self.target_positional, self.target_keywords) if self.has_targets
                   else (self.positional, self.keywords))
        try:
            signature.bind(None, *range(n), **{k: None for k in keys})
        except TypeError as exc:
            fn = getattr(self.loss_fn, "__qualname__", type(self.loss_fn).__name__)
            raise BatchError(
                f"loss_fn {fn}{signature} cannot take (output, {self._loss_args()}): {exc}. "
                f"{'It gets the output and the example_targets' if self.has_targets else 'Without example_targets it gets the output and every model input'}"
                "; pass the parts only the loss reads as example_targets=(...) and write "
                "loss_fn(output, *targets)") from None

    def _forward_hint(self, forward: inspect.Signature) -> str:
        params = [p for p in forward.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        takes_var = any(p.kind == p.VAR_POSITIONAL for p in forward.parameters.values())
        if not takes_var and self.positional > len(params) and not self.has_targets:
            extra = self.positional - len(params)
            return (f" If the last {extra} tensor(s) of the batch are targets for the loss "
                    f"only, compile with example_inputs=(the first {len(params)}), "
                    f"example_targets=(the last {extra}) and loss_fn=lambda output, *targets: "
                    "...; then call step(*inputs, *targets)")
        if self.keywords:
            return (" Rename the batch's keys to forward's arguments, or pass the keys only "
                    "the loss reads as example_targets={...}")
        return " Pass as example_inputs exactly what forward takes"

    def call_form(self) -> str:
        pos = [f"input_{i}" for i in range(self.positional)] + [
            f"target_{i}" for i in range(self.target_positional)]
        kws = [f"{k}=..." for k in (*self.keywords, *self.target_keywords)]
        return f"step({', '.join(pos + kws)})"

    def _model_args(self) -> str:
        parts = [f"{self.positional} positional tensor(s)"] if self.positional else []
        if self.keywords:
            parts.append("keywords " + ", ".join(self.keywords))
        return " and ".join(parts) or "no arguments"

    def _loss_args(self) -> str:
        if self.has_targets:
            names = [f"target_{i}" for i in range(self.target_positional)] + [
                f"{k}=" for k in self.target_keywords]
        else:
            names = [f"input_{i}" for i in range(self.positional)] + [
                f"{k}=" for k in self.keywords]
        return ", ".join(names)


def as_objective(loss_fn: LossFn | Objective | None, n_inputs: int) -> Objective:
    """An Objective as is; a plain loss function in the positional convention
    (`model(*batch)`, `loss_fn(output, *batch)`)."""
    if isinstance(loss_fn, Objective):
        return loss_fn
    return Objective(loss_fn, n_inputs)


def _check_scalar(loss: Any, where: str, hint: bool) -> torch.Tensor:
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        extra = "; pass loss_fn=lambda output, *targets: ... to autopar" if hint else ""
        raise BatchError(f"{where} must be a scalar floating-point tensor, got {shape}{extra}")
    return loss


def _show_call(args: tuple, kwargs: dict) -> str:
    def show(x):
        return f"Tensor{list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
    return ", ".join([show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()])


# -- counts the loss divides by --------------------------------------------------------

LOSS_NORM_INPUT = "loss_norm"  # name prefix of the step inputs that take a global count


@dataclass(frozen=True)
class LossNormalizer:
    """A count the loss is divided by that the batch alone decides: the tokens that are not
    `ignore_index`, the ones of a mask, a class-weighted total. Each data-parallel rank and
    micro-batch (a shard) holds a different count, so a mean over each shard's own count
    is not the mean over the batch. The step takes, as input `name`, the mean of the
    count over all shards of the global batch and divides by that instead (the gradients
    and the loss are then averaged over shards as for any other loss)."""

    name: str
    # fx.GraphModule: one shard's user inputs (flat) -> its summed count; None: the
    # batch's divisor is 1 (a loss that sums over the batch: each shard's divisor is then
    # 1 / shards, so the average over shards is the batch's sum)
    program: Any
    dtype: torch.dtype  # of the step's input (fp32 for integer counts: a mean is fractional)
    # fx.GraphModule: the batch's summed count -> the divisor (a cast, a clamp), or None
    finish: Any = None

    def mean(self, pieces: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        """The divisor of one shard: the batch's divisor over the number of shards."""
        if self.program is None:
            return torch.tensor(1.0 / len(pieces), dtype=self.dtype)
        total = sum(self.program(*piece) for piece in pieces)
        if self.finish is not None:
            total = self.finish(total)
        return (total / len(pieces)).to(self.dtype).reshape(())


def normalizer_means(normalizers: Sequence[LossNormalizer], global_batch: Sequence[torch.Tensor],
                     batch_dims: Sequence[int | None], shards: int) -> list[torch.Tensor]:
    """Each normalizer's divisor for one shard: the global batch's, over the number of
    `shards` (equal slices of the global batch along its batch dims). Every rank holds
    the global batch, so no collective is needed."""
    if not normalizers:
        return []
    pieces = []
    for k in range(shards):
        piece = []
        for x, dim in zip(global_batch, batch_dims):
            if dim is not None:
                size = x.shape[dim] // shards
                x = x.narrow(dim, k * size, size)
            piece.append(x)
        pieces.append(piece)
    with torch.no_grad():
        return [n.mean(pieces) for n in normalizers]
