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
  median over timed steps after warm-up, each side in turn;
- `--launch`: what one region's call costs the host, per path to its kernel (the
  custom op the graph calls, `FusedRegion.launch`, Triton's `fn[grid](...)` with the
  outputs allocated beforehand, the compiled kernel launched directly, the outputs'
  allocation alone, the eager fallback): host microseconds per call, the GPU not waited
  for;
- `--profile`: torch.profiler over a few steps of the fused and the unfused step: host
  time per op, GPU time per kernel and by kind, and the GPU's busy share of the step;
- `--sweep`: per distinct region (the same kernel on the same shapes counted once, with
  how often the step calls it), the GPU time of its kernel under each launch
  configuration (`triton_gen.Launch`: BLOCK, warps, a row looped or not), the host not
  counted (triton.testing.do_bench_cudagraph), each checked against the eager ops.

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
from autopar.compiler.codegen import kernels, triton_gen
from autopar.compiler.codegen.triton_gen import Launch, TensorArg
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


def _fused_calls(tg):
    """Each fused region the step calls: its key, the region, its input nodes."""
    for node in tg.call_nodes():
        if node.target is kernels.FUSED_OP:
            key, args = node.args
            yield key, kernels.region(key), args


def _max_err(outs, ref) -> float:
    """The largest difference of the kernel's outputs from the eager ops' (floats), or
    the count of differing elements (masks, integers)."""
    return max(((o.float() - r.float()).abs().max().item() if o.is_floating_point() else
                float((o != r).sum().item())) for o, r in zip(outs, ref)) if outs else 0.0


def per_region(tg, bandwidth: float, inductor: bool = True) -> list[dict]:
    rows = []
    for key, region, args in _fused_calls(tg):
        row = {"region": region.name, "key": key}
        try:
            inputs = [_random_like(a.meta[M.VAL]) for a in args]
            outs = region.launch(inputs)
            ref = region.fallback(inputs)
            row["max_abs_err"] = _max_err(outs, ref)
            row["triton_ms"] = triton.testing.do_bench(lambda r=region, x=inputs: r.launch(x))
            row["eager_ms"] = triton.testing.do_bench(lambda r=region, x=inputs: r.fallback(x))
            if inductor:
                compiled = torch.compile(region.gm)
                compiled(*inputs)
                row["inductor_ms"] = triton.testing.do_bench(lambda c=compiled, x=inputs: c(*x))
            row["bytes"] = _nbytes(inputs) + _nbytes(outs)
            row["roofline"] = row["bytes"] / (row["triton_ms"] * 1e-3) / bandwidth
        except Exception as exc:  # noqa: BLE001 - reported per region, never dropped
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    return rows


def _host_us(fn, reps: int) -> float:
    """Host microseconds per call of `fn`, the GPU not waited for inside the loop (the
    launch queue holds far more than `reps` kernels)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / reps * 1e6


def launch_costs(tg, reps: int = 200) -> list[dict]:
    """Host cost of one region's call by each path to its kernel (see the docstring)."""
    rows = []
    for key, region, args in _fused_calls(tg):
        row = {"region": region.name, "inputs": len(args)}
        try:
            inputs = [_random_like(a.meta[M.VAL]) for a in args]
            outs = region.launch(inputs)
            src, fn, _ = region._kernels[kernels.input_key(inputs)]
            row["outputs"] = len(outs)
            seeds = list(range(3, 3 + src.seeds))
            row["op_us"] = _host_us(lambda: kernels.FUSED_OP(key, inputs), reps)
            row["launch_us"] = _host_us(lambda: region.launch(inputs), reps)
            row["triton_us"] = _host_us(
                lambda: fn[(src.grid,)](*inputs, *outs, *seeds, BLOCK=src.block), reps)
            row["key_us"] = _host_us(lambda: hash(kernels.input_key(inputs)), reps)
            row["alloc_us"] = _host_us(
                lambda: [torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device="cuda")
                         for o in src.outputs], reps)
            row["eager_us"] = _host_us(lambda: region.fallback(inputs), reps)
            try:  # Triton's compiled kernel, launched without the JIT's argument binding
                binary = fn[(src.grid,)](*inputs, *outs, *seeds, BLOCK=src.block)
                runner = binary[(src.grid, 1, 1)]
                row["compiled_us"] = _host_us(
                    lambda: runner(*inputs, *outs, *seeds, src.block), reps)
            except Exception as exc:  # noqa: BLE001 - reported, never dropped
                row["compiled_error"] = f"{type(exc).__name__}: {exc}"[:300]
        except Exception as exc:  # noqa: BLE001 - reported per region, never dropped
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    return rows


def _candidates(src) -> list[Launch]:
    """Launch configurations to time for a kernel the rule generated as `src`."""
    width = src.block if src.kind == "row" else None
    if src.kind == "pointwise":
        return [Launch(b, w) for b in (256, 512, 1024, 2048, 4096) for w in (1, 2, 4, 8)
                if 32 * w <= b and b // (32 * w) <= 32]
    out = []
    if src.kind == "row":
        out += [Launch(width, w, False) for w in (1, 2, 4, 8, 16, 32) if 32 * w <= 4 * width]
    if src.kind == "looped row" or width >= 1024:
        out += [Launch(b, w, True) for b in (512, 1024, 2048, 4096, 8192) for w in (4, 8, 16)
                if width is None or b < width]
    return out


def _gpu_ms(src, fn, inputs) -> float:
    """The kernel's GPU time, outputs allocated once, the host's launch cost not counted."""
    outs = [torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device="cuda")
            for o in src.outputs]
    seeds = list(range(3, 3 + src.seeds))

    def call():
        fn[(src.grid,)](*inputs, *outs, *seeds, BLOCK=src.block, num_warps=src.num_warps)
    call()
    try:
        return triton.testing.do_bench_cudagraph(call, rep=20)
    except Exception:  # noqa: BLE001 - a kernel capture refuses is timed with the host
        return triton.testing.do_bench(call, rep=20)


def sweep(tg, bandwidth: float, budget_s: float) -> list[dict]:
    """Per distinct region, its kernel's GPU time under each candidate launch (see the
    module docstring); stops starting regions after `budget_s` seconds."""
    rows, seen, start = [], {}, time.perf_counter()
    for key, region, args in _fused_calls(tg):
        fakes = [a.meta[M.VAL] for a in args]
        targs = [TensorArg.of(f) for f in fakes]
        try:
            rule = region.source(targs)
        except Exception as exc:  # noqa: BLE001 - reported per region, never dropped
            rows.append({"region": region.name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        ident = (rule.text, tuple(targs), rule.block, rule.kind)
        if ident in seen:
            seen[ident]["calls"] += 1
            continue
        row = seen[ident] = {"region": region.name, "kind": rule.kind, "calls": 1,
                             "grid": rule.grid, "rule": [rule.block, rule.num_warps],
                             "shapes": [list(a.shape) for a in targs], "configs": []}
        rows.append(row)
        if time.perf_counter() - start > budget_s:
            row["skipped"] = "the sweep's time budget was spent"
            continue
        inputs = [_random_like(f) for f in fakes]
        ref = region.fallback(inputs)
        row["bytes"] = _nbytes(inputs) + _nbytes(ref)
        for launch in [None, *_candidates(rule)]:
            cfg = {"block": rule.block if launch is None else launch.block,
                   "warps": rule.num_warps if launch is None else launch.num_warps,
                   "looped": rule.kind == "looped row" if launch is None or launch.looped is None
                   else launch.looped, "rule": launch is None}
            try:
                src = triton_gen.generate(region.gm, targs, region.name, launch)
                fn = kernels._compile(src)
                outs = kernels._launcher(src, fn)(inputs)
                cfg["max_abs_err"] = _max_err(outs, ref)
                cfg["ms"] = _gpu_ms(src, fn, inputs)
                cfg["roofline"] = row["bytes"] / (cfg["ms"] * 1e-3) / bandwidth
            except Exception as exc:  # noqa: BLE001 - reported per configuration
                cfg["error"] = f"{type(exc).__name__}: {exc}"[:300]
            row["configs"].append(cfg)
    return rows


def _kind(kernel: str) -> str:
    name = kernel.lower()
    if any(k in name for k in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "splitk")):
        return "matmul"
    if any(k in name for k in ("flash", "fmha", "attention", "cudnn")):
        return "attention"
    if kernel.startswith(tuple(r.name for r in kernels._REGIONS.values())):
        return "autopar triton"
    if "triton" in name:
        return "other triton"
    return "other"


def profile_steps(sides: dict, batch, steps: int = 3) -> dict:
    """torch.profiler over `steps` steps of each side: host time per op, GPU time per
    kernel and by kind, and the GPU busy share of the wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, step in sides.items():
        step(*batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step(*batch)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / steps * 1e3
        kernels_us: dict[str, list] = {}
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                k = kernels_us.setdefault(e.name, [0.0, 0])
                k[0] += e.time_range.elapsed_us() / steps
                k[1] += 1 / steps
        by_kind: dict[str, float] = {}
        for k, (us, _) in kernels_us.items():
            by_kind[_kind(k)] = by_kind.get(_kind(k), 0.0) + us / 1e3
        host = sorted(((e.key, e.self_cpu_time_total / steps / 1e3, e.count / steps,
                        e.cpu_time_total / steps / 1e3) for e in prof.key_averages()),
                      key=lambda r: -r[1])
        out[name] = {
            "wall_ms": wall,
            "gpu_busy_ms": sum(us for us, _ in kernels_us.values()) / 1e3,
            "kernels": sum(n for _, n in kernels_us.values()),
            "gpu_ms_by_kind": by_kind,
            "top_kernels": sorted(([k, us / 1e3, n] for k, (us, n) in kernels_us.items()),
                                  key=lambda r: -r[1])[:25],
            "top_host_ops": [list(r) for r in host[:30]],  # name, self ms, calls, total ms
        }
    return out


def step_sides(example) -> dict:
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
    return sides


def step_times(sides: dict, batch, steps: int, warmup: int) -> dict:
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
    p.add_argument("--no-inductor", action="store_true",
                   help="per region: skip torch.compile of each region")
    p.add_argument("--launch", action="store_true", help="host cost of a region's call by path")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler of the fused and the unfused step")
    p.add_argument("--sweep", type=float, default=None, metavar="SECONDS",
                   help="time each distinct region's kernel under candidate launch "
                        "configurations, for at most about SECONDS")
    p.add_argument("--no-regions", action="store_true", help="skip the per-region comparison")
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
              "regions": [] if args.no_regions else
              per_region(step.train_graph, args.bandwidth, not args.no_inductor)}
    if args.sweep is not None:
        result["sweep"] = sweep(step.train_graph, args.bandwidth, args.sweep)
    if args.launch:
        result["launch_us"] = launch_costs(step.train_graph)
    sides = step_sides(example)
    result["step_ms"] = step_times(sides, batch, args.steps, 5)
    if args.profile:
        result["profile"] = profile_steps(
            {n: sides[n] for n in ("autopar fused", "autopar unfused", "torch.compile")}, batch)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
