"""The cost model against one real GPU: GEMMs of transformer shapes, the fused attention
kernel, and whole training steps of transformers models, measured on the GPU and
predicted by `autopar.estimate` on the preset and on the `autopar calibrate` spec.

On the GPU (one process, CUDA; writes the measurements):

    python benchmarks/gpu_fidelity.py measure --out gpu_fidelity.json

Then anywhere (this CPU machine: the models are built on the meta device):

    python benchmarks/gpu_fidelity.py predict gpu_fidelity.json --preset dgx-h100 \
        --calibrated h100.yaml

- GEMMs: bf16 `mm` of the shapes a transformer layer of hidden h runs on T tokens
  (q/k/v, projection, the MLP's two, and the weight gradients, whose inner dimension is
  T), over several h; the cost model's time for each (the roofline at peak x
  Efficiency.compute) against the measured one.
- Attention: causal bf16 `scaled_dot_product_attention` forward + backward at several
  shapes, as FLOP/s counted the cost model's way (the whole s x s).
- Steps: forward under bf16 autocast, the causal-LM loss (autopar.examples'
  causal_lm_loss), backward, torch's AdamW (foreach), median of timed steps after
  warm-up, and the peak of allocated memory; predicted as `Layout(dp=1, amp="bf16")`,
  what autopar's compiled step of the same model would run on that one GPU. The measured
  side is eager PyTorch, not autopar's step: no GPU build of the pinned torch was there.

Figures: docs/benchmarks.md ("The cost model on one GPU").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from autopar.layout import Layout

ONE_GPU = Layout(dp=1, amp="bf16")  # what `predict` costs each measured step as
# (name, transformers class, config, micro-batch, sequence)
MODELS = [
    ("gpt2-124m", "GPT2", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                               n_positions=1024), 8, 1024),
    ("gpt2-760m", "GPT2", dict(n_embd=1536, n_layer=24, n_head=12, vocab_size=50257,
                               n_positions=2048), 4, 2048),
    ("llama-1.2b", "Llama", dict(hidden_size=2048, num_hidden_layers=16,
                                 num_attention_heads=32, num_key_value_heads=32,
                                 intermediate_size=8192, vocab_size=32000,
                                 max_position_embeddings=2048), 4, 2048),
]
HIDDEN = (1024, 1536, 2048, 4096, 5120)
TOKENS = (4096, 16384)
ATTENTION = [(4, 16, 2048, 128), (8, 12, 1024, 64), (2, 32, 4096, 128), (4, 32, 2048, 64)]


def build(name: str, device: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    _, kind, config, batch, seq = next(m for m in MODELS if m[0] == name)
    cls, cfg = ((GPT2LMHeadModel, GPT2Config) if kind == "GPT2" else
                (LlamaForCausalLM, LlamaConfig))
    with torch.device(device):
        model = cls(cfg(**config, use_cache=False, attn_implementation="sdpa"))
        ids = (torch.randint(0, config["vocab_size"], (batch, seq)) if device != "meta" else
               torch.empty((batch, seq), dtype=torch.long))
    return model, ids


def gemm_shapes(h: int, t: int) -> list[tuple[str, int, int, int]]:
    """(what, M, N, K) of one layer's GEMMs on t tokens: forward and the weight gradient."""
    out = []
    for what, n_in, n_out in (("qkv", h, 3 * h), ("proj", h, h), ("fc1", h, 4 * h),
                              ("fc2", 4 * h, h)):
        out.append((f"{what} fwd", t, n_out, n_in))
        out.append((f"{what} dW", n_in, n_out, t))
    return out


def _cuda_median(fn, repeats: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _category(kernel: str) -> str:
    name = kernel.lower()
    if any(k in name for k in ("flash", "fmha", "attention")):
        return "attention"
    if any(k in name for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas")):
        return "gemm"
    if "triton" in name:
        return "triton"
    return "other"


def profile_step(step) -> dict:
    """GPU time of one step's kernels by kind (GEMM, attention, Triton, other), the
    busiest kernels, and the step's wall time under the profiler."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    kinds, kernels, count = defaultdict(float), defaultdict(float), 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        seconds = e.time_range.elapsed_us() / 1e6
        if _is_annotation(e.name):  # a range around kernels, e.g. the optimizer's step
            kinds[e.name] += seconds
            continue
        kinds[_category(e.name)] += seconds
        kernels[e.name[:90]] += seconds
        count += 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    return {"kernel_seconds": dict(kinds), "wall_s": wall, "top": top, "kernels": count}


def _is_annotation(name: str) -> bool:
    """A user range the profiler also draws on the GPU's timeline
    ("Optimizer.step#AdamW.step"), not a kernel."""
    return name.startswith(("Optimizer.", "ProfilerStep"))


def measure_steps(name: str, steps: int, compiled: bool) -> dict:
    """Eager (and torch.compile'd) training steps of one model: median wall time, peak
    memory, one profiled step, and the optimizer's share."""
    from autopar.examples import causal_lm_loss

    torch.manual_seed(0)
    model, ids = build(name, "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss_of(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return causal_lm_loss(model(input_ids=ids), ids)
    row = {"model": name, "batch": list(ids.shape)}
    sides = [("eager", loss_of)] + ([("compiled", torch.compile(loss_of))] if compiled else [])
    for side, fn in sides:
        def step(fn=fn):
            fn(ids).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        start = time.perf_counter()
        try:
            step()  # the compiled side compiles here
        except Exception as exc:  # recorded: the other side's figures still count
            row[side] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"{name} {side}: failed: {row[side]['error'][:300]}", flush=True)
            continue
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(steps + 2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - start)
        opt_s = _cuda_median(opt.step, repeats=5, warmup=1)
        row[side] = {"times": times, "median_s": statistics.median(times), "first_s": first,
                     "peak_bytes": torch.cuda.max_memory_allocated(), "optimizer_s": opt_s,
                     "profile": profile_step(step)}
        print(f"{name} {side}: {statistics.median(times) * 1e3:.1f} ms (first {first:.1f} s)",
              flush=True)
    # the first side's figures at the top level, as `predict` reads them
    row.update(median_s=row["eager"]["median_s"], peak_bytes=row["eager"]["peak_bytes"])
    return row


def measure(out: str, steps: int, compiled: bool = True, kernels: bool = True,
            models: list[str] | None = None, cudnn_attention: bool = True) -> None:
    from autopar.calibrate import measure_gpu_attention

    # torch.compile picks cuDNN's attention where it can (eager sdpa picks FlashAttention);
    # without cuDNN both sides run FlashAttention, the kernel the cost model's figure is
    torch.backends.cuda.enable_cudnn_sdp(cudnn_attention)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "cudnn_attention": cudnn_attention, "gemm": [], "attention": [], "steps": []}
    for h in (HIDDEN if kernels else ()):
        for t in TOKENS:
            for what, m, n, k in gemm_shapes(h, t):
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
                s = _cuda_median(lambda: torch.mm(a, b))
                result["gemm"].append({"hidden": h, "tokens": t, "what": what, "m": m, "n": n,
                                       "k": k, "seconds": s, "tflops": 2 * m * n * k / s / 1e12})
        print(f"gemm h={h}: done", flush=True)
    for shape in (ATTENTION if kernels else ()):
        rate, _ = measure_gpu_attention(*shape, repeats=10)  # what autopar calibrate runs
        result["attention"].append({"shape": shape, "tflops": rate / 1e12})
    print("attention: done", flush=True)
    for name in models or [m[0] for m in MODELS]:
        result["steps"].append(measure_steps(name, steps, compiled))
        with open(out, "w") as f:  # what is measured so far survives a timeout
            json.dump(result, f, indent=1)
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})


def predicted_kinds(model, ids, cluster) -> dict[str, float]:
    """The cost model's seconds of the step by kind of kernel, as `profile_step` sorts
    the measured ones, and its count of kernels (ops that take time)."""
    from autopar.compiler.planner.cost_model import _op_time
    from autopar.compiler.planner.estimate import Estimator, Objective
    from autopar.costs import ATTENTION_KERNELS, DEFAULT_EFFICIENCY
    from autopar.examples import causal_lm_loss

    layout = ONE_GPU
    objective, flat = Objective.from_example((ids,), None, causal_lm_loss)
    est = Estimator(model, cluster, flat, objective, "adamw", DEFAULT_EFFICIENCY, None, "auto")
    summary = est.rewritten(layout, timing=True)[0]
    kinds = {"gemm": 0.0, "attention": 0.0, "elementwise": 0.0, "kernels": 0}
    for op in summary.ops:
        seconds = _op_time(op, cluster, DEFAULT_EFFICIENCY)
        if seconds <= 0:
            continue
        kind = ("attention" if op.target in ATTENTION_KERNELS else
                "gemm" if op.target in GEMMS else "elementwise")
        kinds[kind] += seconds
        kinds["kernels"] += op.repeat
    kinds["optimizer"] = est.predict(layout).breakdown["optimizer"]
    return kinds


def measured_kinds(side: dict) -> dict[str, float]:
    """`profile_step`'s kinds folded as `predicted_kinds` has them."""
    k = side["profile"]["kernel_seconds"]
    optimizer = sum(v for name, v in k.items() if _is_annotation(name))
    # every kernel not a GEMM, attention or Triton's (the first files of 2026-11-27 kept
    # the annotation in "other", and some kernels under their own names)
    other = sum(v for name, v in k.items()
                if name not in ("gemm", "attention", "triton") and not _is_annotation(name))
    if not optimizer:
        optimizer = sum(v for name, v in side["profile"]["top"] if _is_annotation(name))
        other -= optimizer
    # the optimizer's kernels ran in "other" (foreach multi_tensor_apply)
    return {"gemm": k.get("gemm", 0.0), "attention": k.get("attention", 0.0),
            "elementwise": other + k.get("triton", 0.0) - optimizer, "optimizer": optimizer,
            "kernels": side["profile"]["kernels"]}


def predict(path: str, preset: str, calibrated: str | None) -> None:
    import logging

    import autopar
    from autopar.costs import DEFAULT_EFFICIENCY
    from autopar.examples import causal_lm_loss

    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    data = json.loads(open(path).read())
    def one_gpu(spec):
        return autopar.ClusterSpec.from_dict({**spec.to_dict(), "nodes": 1,
                                              "devices_per_node": 1}, source=spec.name)
    clusters = {preset: one_gpu(autopar.ClusterSpec.preset(preset))}
    if calibrated:
        clusters["calibrated"] = one_gpu(autopar.ClusterSpec.from_yaml(calibrated))
    print(f"measured on {data['device']} (torch {data['torch']})\n")
    print("| model | micro-batch | measured eager: step, peak | torch.compile: step, peak | "
          "compiled, attention at eager's time | "
          + " | ".join(f"{c}: step, peak, error vs the previous column" for c in clusters) + " |")
    print("|---|---|---|---|---|" + "---|" * len(clusters))
    for row in data["steps"]:
        model, ids = build(row["model"], "meta")
        compiled = row.get("compiled", {})
        # the compiled step with its attention kernels' time replaced by eager's (torch.compile
        # ran cuDNN's attention here, eager FlashAttention: the kernel the model prices)
        reference = (compiled["median_s"] - measured_kinds(compiled)["attention"]
                     + measured_kinds(row["eager"])["attention"]
                     if "profile" in compiled and "profile" in row.get("eager", {}) else None)
        cells = []
        for cluster in clusters.values():
            pred = autopar.estimate(model, cluster, ONE_GPU, (ids,), causal_lm_loss)
            error = "" if reference is None else f", {pred.step_time_s / reference - 1:+.1%}"
            cells.append(f"{pred.step_time_s * 1e3:.1f} ms, "
                         f"{pred.peak_memory_bytes / 1e9:.1f} GB{error}")
        print(f"| {row['model']} | {row['batch'][0]} x {row['batch'][1]} | "
              f"{row['median_s'] * 1e3:.1f} ms, {row['peak_bytes'] / 1e9:.1f} GB | "
              + (f"{compiled['median_s'] * 1e3:.1f} ms, {compiled['peak_bytes'] / 1e9:.1f} GB"
                 if "median_s" in compiled else "-") + " | "
              + ("-" if reference is None else f"{reference * 1e3:.1f} ms") + " | "
              + " | ".join(cells) + " |", flush=True)
    if all("eager" in row and "profile" in row["eager"] for row in data["steps"]):
        print("\nWhere the time goes (ms of GPU time in one step; kernels counted):\n")
        print("| model | side | GEMM | attention | other kernels | optimizer | kernels |")
        print("|---|---|---|---|---|---|---|")
        for row in data["steps"]:
            model, ids = build(row["model"], "meta")
            sides = [(side, measured_kinds(row[side])) for side in ("eager", "compiled")
                     if "profile" in row.get(side, {})]
            sides += [(f"predicted, {name}", predicted_kinds(model, ids, cluster))
                      for name, cluster in clusters.items()]
            for side, k in sides:
                print(f"| {row['model']} | {side} | {k['gemm'] * 1e3:.1f} | "
                      f"{k['attention'] * 1e3:.1f} | {k['elementwise'] * 1e3:.1f} | "
                      f"{k['optimizer'] * 1e3:.1f} | {k['kernels']} |", flush=True)
    print()
    for name, cluster in clusters.items():
        peak = cluster.peak_flops_for("bf16") * DEFAULT_EFFICIENCY.compute
        ratios = [g["tflops"] * 1e12 / peak for g in data["gemm"]]
        print(f"GEMMs on {name}: modelled {peak / 1e12:.0f} TFLOP/s; measured / modelled "
              f"median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-"
              f"{max(ratios):.2f} over {len(ratios)} shapes")
        if cluster.device.attention_efficiency is not None:
            att = cluster.peak_flops_for("bf16") * cluster.device.attention_efficiency
        else:
            att = peak
        print(f"attention on {name}: modelled {att / 1e12:.0f} TFLOP/s; measured "
              + ", ".join(f"{tuple(a['shape'])} {a['tflops']:.0f}" for a in data["attention"]))
    print("\n| hidden | tokens | GEMM | measured TFLOP/s |")
    print("|---|---|---|---|")
    for g in data["gemm"]:
        print(f"| {g['hidden']} | {g['tokens']} | {g['what']} ({g['m']} x {g['n']} x {g['k']}) | "
              f"{g['tflops']:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="on the GPU")
    m.add_argument("--out", default="gpu_fidelity.json")
    m.add_argument("--steps", type=int, default=10)
    m.add_argument("--no-compile", action="store_true", help="eager steps only")
    m.add_argument("--no-kernels", action="store_true", help="steps only (no GEMM and "
                   "attention grids)")
    m.add_argument("--models", nargs="+", choices=[m[0] for m in MODELS], default=None)
    m.add_argument("--no-cudnn-attention", action="store_true",
                   help="keep sdpa off cuDNN's kernel (torch.compile picks it where it can)")
    r = sub.add_parser("predict", help="the cost model's figures for the measured ones")
    r.add_argument("measured")
    r.add_argument("--preset", default="dgx-h100")
    r.add_argument("--calibrated", default=None, help="a spec from autopar calibrate")
    args = p.parse_args()
    if args.cmd == "measure":
        measure(args.out, args.steps, not args.no_compile, not args.no_kernels, args.models,
                not args.no_cudnn_attention)
    else:
        predict(args.measured, args.preset, args.calibrated)


if __name__ == "__main__":
    main()
