"""Fusion on a GPU: each fused region's Triton kernel against the region's eager aten
ops and against Inductor's code for the same region, and a training step with fusion
against eager PyTorch, torch.compile and autopar without fusion. One process, CUDA.

    python benchmarks/fusion_gpu.py --layers 4 --hidden 256 --out fusion_gpu.json

- per region: the median time of the Triton kernel autopar generated (FusedRegion.launch),
  of the region's own aten ops run eagerly (FusedRegion.fallback), and of
  torch.compile(region) (Inductor), on random inputs of the region's shapes, strides and
  dtypes (triton.testing.do_bench); its bytes (inputs read + outputs written) over the
  kernel's time, against the device's memory bandwidth;
- the step: forward + loss + backward + SGD of GPT-2 (transformers, a small config),
  median over timed steps after warm-up, each side in turn.

Figures and the conditions they were taken in: docs/benchmarks.md ("On a GPU").
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import triton.testing

import autopar
from autopar.compiler.codegen import kernels
from autopar.compiler.ir import meta as M
from autopar.examples import gpt2


def _random_like(fake: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor of `fake`'s shape, strides and dtype: normal floats, 0/1 masks and
    small integers (indices stay in range)."""
    size = sum((s - 1) * st for s, st in zip(fake.shape, fake.stride())) + 1
    if fake.dtype.is_floating_point:
        flat = torch.randn(size, device="cuda").to(fake.dtype)
    elif fake.dtype == torch.bool:
        flat = torch.rand(size, device="cuda") > 0.1
    else:
        flat = torch.zeros(size, dtype=fake.dtype, device="cuda")
    return flat.as_strided(fake.shape, fake.stride())


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def per_region(tg, bandwidth: float) -> list[dict]:
    rows = []
    for node in tg.call_nodes():
        if node.target is not kernels.FUSED_OP:
            continue
        key, args = node.args
        region = kernels.region(key)
        row = {"region": region.name, "key": key}
        try:
            inputs = [_random_like(a.meta[M.VAL]) for a in args]
            outs = region.launch(inputs)
            ref = region.fallback(inputs)
            row["max_abs_err"] = max(
                ((o.float() - r.float()).abs().max().item() if o.is_floating_point() else
                 float((o != r).sum().item())) for o, r in zip(outs, ref)) if outs else 0.0
            compiled = torch.compile(region.gm)
            compiled(*inputs)
            row["triton_ms"] = triton.testing.do_bench(lambda r=region, x=inputs: r.launch(x))
            row["eager_ms"] = triton.testing.do_bench(lambda r=region, x=inputs: r.fallback(x))
            row["inductor_ms"] = triton.testing.do_bench(lambda c=compiled, x=inputs: c(*x))
            row["bytes"] = _nbytes(inputs) + _nbytes(outs)
            row["roofline"] = row["bytes"] / (row["triton_ms"] * 1e-3) / bandwidth
        except Exception as exc:  # noqa: BLE001 - reported per region, never dropped
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    return rows


def step_times(example, steps: int, warmup: int) -> dict:
    def sgd(params):
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    batch = tuple(x.cuda() for x in example.batch)
    sides = {}
    for name, fusion in (("autopar fused", True), ("autopar unfused", False)):
        model = copy.deepcopy(example.model).cuda()
        sides[name] = autopar.compile(model, None, batch, example.loss_fn, optimizer=sgd,
                                      layout=autopar.Layout(fusion=fusion))

    def eager_side(compiled: bool):
        model = copy.deepcopy(example.model).cuda()
        opt = sgd(list(model.parameters()))
        forward = torch.compile(model) if compiled else model

        def step(*b):
            loss = example.loss_fn(forward(*b), *b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss
        return step

    sides["eager PyTorch"] = eager_side(False)
    sides["torch.compile"] = eager_side(True)
    times = {n: [] for n in sides}
    for k in range(warmup + steps):
        for name, step in sides.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(*batch)
            torch.cuda.synchronize()
            if k >= warmup:
                times[name].append(time.perf_counter() - start)
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s (H200: 4.8e12)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    example = gpt2(layers=args.layers, hidden=args.hidden, heads=8, vocab=args.vocab,
                   batch=args.batch, seq=args.seq)
    batch = tuple(x.cuda() for x in example.batch)
    model = copy.deepcopy(example.model).cuda()
    start = time.perf_counter()
    step = autopar.compile(model, None, batch, example.loss_fn,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3),
                           layout=autopar.Layout(fusion=True))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": vars(args), "compile_s": time.perf_counter() - start,
              "regions": per_region(step.train_graph, args.bandwidth),
              "step_ms": step_times(example, args.steps, 5)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
