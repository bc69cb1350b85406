"""Fused regions as one torch.library custom op, their Triton kernels and the kernel cache.

The fusion pass replaces each region by `autopar::fused(key, inputs) -> outputs`.
`key` is a content hash of the region (its aten graph and input shapes/dtypes) and
names a `FusedRegion` registered in this process, which holds the region's original
aten ops as a GraphModule. Calling the op runs, by the backend in force:

- "auto" (default): the Triton kernel for CUDA tensors, the eager fallback (the
  region's own aten ops, so results are bit-identical to the unfused graph) otherwise;
- "triton": the Triton kernel always (on CPU this needs `TRITON_INTERPRET=1` set
  before triton is first imported: the tests run kernels that way);
- "eager": the fallback always.

Kernels are generated and compiled lazily, on the first call with given input
shapes, strides and dtypes, and cached in memory by (region key, inputs) and on disk
by the hash of their source (`kernel_dir()`), so a process pays for each once.

Where the kernels run, the runtime calls them without the custom op (`runnable_regions`):
the op's dispatch costs the host about as much again as the launch, and a step of small
kernels is bound by the host (docs/fusion.md, "The launch path").
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import operator
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx

from autopar.compiler.codegen.ops import Unsupported
from autopar.compiler.codegen.triton_gen import (
    COLUMN,
    KernelSource,
    TensorArg,
    generate,
)
from autopar.compiler.ir.program import register_run_rule

BACKENDS = ("auto", "triton", "eager")
_state = {"backend": "auto", "dir": Path(tempfile.gettempdir()) / "autopar-kernels"}
_REGIONS: dict[str, FusedRegion] = {}


@dataclass
class FusedRegion:
    key: str
    name: str  # readable, e.g. "native_layer_norm_mul"
    gm: fx.GraphModule  # the region's original aten ops (the fallback)
    # input_key(inputs) -> (KernelSource, the @triton.jit function, its launch: everything
    # but the tensors bound)
    _kernels: dict = field(default_factory=dict)
    # inputs (TensorArgs) -> None when the generator emits the region for them, else why
    # not: `check`'s verdicts (the planner fuses the same blocks under many layouts)
    _verdicts: dict = field(default_factory=dict)

    def source(self, args: list[TensorArg]) -> KernelSource:
        return generate(self.gm, args, self.name)

    def check(self, args: list[TensorArg]) -> None:
        """Raise Unsupported (with the generator's reason) when `source(args)` would:
        the verdict is kept per inputs, since the source is a function of the region's
        ops, which its key hashes, and of `args`."""
        spec = tuple(args)
        if spec not in self._verdicts:
            try:
                self.source(args)
                self._verdicts[spec] = None
            except Unsupported as exc:
                self._verdicts[spec] = str(exc)
        if self._verdicts[spec] is not None:
            raise Unsupported(self._verdicts[spec])

    def fallback(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The region's own aten ops. An output that is a view of another output (a
        region may return a value and its reshape) is copied: a custom op's outputs
        must not alias each other or its inputs."""
        outs = list(self.gm(*inputs))
        seen = {t.untyped_storage().data_ptr() for t in inputs}
        for i, t in enumerate(outs):
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                outs[i] = t.clone()
            seen.add(ptr)
        return outs

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.fallback(inputs) if would_run_fallback(inputs) else self.launch(inputs)

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The Triton kernel on `inputs`: its outputs, freshly allocated. The kernel is
        generated and compiled on the first call with inputs of these shapes, strides
        and dtypes."""
        key = input_key(inputs)
        if key not in self._kernels:
            src = self.source([TensorArg.of(t) for t in inputs])
            fn = _compile(src)
            self._kernels[key] = (src, fn, _launcher(src, fn))
        return self._kernels[key][2](inputs)


def input_key(inputs: list[torch.Tensor]) -> tuple:
    """What a region's kernel is specialised to (TensorArg), per input: shape, stride
    and dtype, as a plain tuple (cheap to build on every call)."""
    return tuple((t.shape, t.stride(), t.dtype) for t in inputs)


def _launcher(src: KernelSource, fn):
    """The launch of `fn` with what does not change from call to call (grid, block,
    outputs' layouts) computed once: each call allocates the outputs and launches."""
    kernel, block, draws, warps = fn[(src.grid,)], src.block, src.seeds, src.num_warps
    # per output: zeroed (column sums accumulate into it), shape, stride, dtype
    layouts = [(o.kind == COLUMN, o.shape, o.stride, o.dtype) for o in src.outputs]

    def launch(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        device = inputs[0].device
        outs = [torch.zeros(shape, dtype=dtype, device=device) if zeroed else
                torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for zeroed, shape, stride, dtype in layouts]
        # a fresh Philox seed per draw and launch, from torch's CPU generator:
        # torch.manual_seed reproduces the masks; the eager fallback draws from the
        # device's generator instead
        seeds = torch.randint(0, 2 ** 31 - 1, (draws,)).tolist() if draws else ()
        kernel(*inputs, *outs, *seeds, BLOCK=block, num_warps=warps)
        return outs
    return launch


def would_run_fallback(inputs: list[torch.Tensor]) -> bool:
    """Whether a fused region on `inputs` runs its eager fallback under the backend in
    force (not the Triton kernel)."""
    backend = _state["backend"]
    return not (backend == "triton" or (backend == "auto" and inputs and inputs[0].is_cuda))


def region_key(gm: fx.GraphModule, args: list[TensorArg]) -> str:
    """Content hash of a region: its aten graph (each node's op, target and arguments,
    in order: what its Python code is generated from, read without generating it) and
    its inputs' shapes and dtypes."""
    ops = "\n".join(f"{n.op}|{n.name}|{n.target}|{n.args}|{n.kwargs}" for n in gm.graph.nodes)
    spec = "|".join(f"{a.shape}:{a.dtype}" for a in args)
    return hashlib.sha256((ops + spec).encode()).hexdigest()[:16]


def register_region(gm: fx.GraphModule, args: list[TensorArg], name: str) -> FusedRegion:
    key = region_key(gm, args)
    if key not in _REGIONS:
        _REGIONS[key] = FusedRegion(key, name, gm)
    return _REGIONS[key]


def region(key: str) -> FusedRegion:
    if key not in _REGIONS:
        raise KeyError(f"fused region {key} is not registered in this process: the graph was "
                       "fused elsewhere; run the fusion pass (autopar.compile with "
                       "Layout(fusion=True)) in the process that runs the step")
    return _REGIONS[key]


@contextlib.contextmanager
def backend(name: str):
    """Run fused regions with `name` ("auto", "triton", "eager") inside the block."""
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {list(BACKENDS)}, got {name!r}")
    old, _state["backend"] = _state["backend"], name
    try:
        yield
    finally:
        _state["backend"] = old


def kernel_dir() -> Path:
    return _state["dir"]


def _compile(src: KernelSource):
    """Import the kernel's module from the disk cache (triton.jit reads the source file)."""
    path = kernel_dir() / f"{src.name}.py"
    if not path.exists() or path.read_text() != src.text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{id(src)}.tmp")
        tmp.write_text(src.text)
        tmp.replace(path)
    spec = importlib.util.spec_from_file_location(f"autopar_kernels.{src.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, src.name)


@torch.library.custom_op("autopar::fused", mutates_args=())
def fused(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One fused region (see the module docstring)."""
    return region(key).run(inputs)


@fused.register_fake
def _fused_fake(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in region(key).gm(*inputs)]  # fresh outputs, no aliasing


FUSED_OP = torch.ops.autopar.fused.default


# -- where no kernel runs: the regions' ops inline ------------------------------------------

_INLINED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_DIRECT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def runnable_regions(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> fx.GraphModule:
    """The module the runtime runs on `inputs` (program.runnable's rule):
    - where the regions' Triton kernels run (CUDA tensors under "auto", any under
      "triton"): `gm` with each region called directly (`direct_regions`), not through
      the custom op's dispatch;
    - where they would all run their eager fallback under "auto" (CPU tensors): `gm` with
      each region's ops inline (`inline_regions`);
    - under "eager": `gm` itself, the fallback region by region through the op, as tests
      of the fused graph ask for."""
    if not inputs or _state["backend"] == "eager":
        return gm
    cache, rewrite = ((_INLINED, inline_regions) if would_run_fallback(inputs)
                      else (_DIRECT, direct_regions))
    if gm not in cache:
        cache[gm] = rewrite(gm)
    return cache[gm]


register_run_rule(runnable_regions)


def launch_region(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What `direct_regions` calls in place of the custom op: region `key` on `inputs`,
    as the op runs it (the Triton kernel; the fallback for a region whose own inputs are
    not where kernels run)."""
    return _REGIONS[key].run(inputs)


def direct_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` whose fused regions call their kernels directly (`launch_region`):
    the same kernels on the same inputs as the custom op runs, without its dispatch
    (`gm` itself if it has none)."""
    if not any(n.target is FUSED_OP for n in gm.graph.nodes):
        return gm
    graph, _ = _graph_copy(gm)
    for node in graph.nodes:
        if node.target is FUSED_OP:
            node.target = launch_region
    graph.lint()
    return fx.GraphModule(gm, graph)


def _graph_copy(gm: fx.GraphModule) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A new graph of gm's nodes, and the map from each of gm's nodes to its copy."""
    graph = fx.Graph()
    remap: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, remap))
    return graph, remap


def inline_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` with each fused region's call replaced by the region's own aten ops
    (`gm` itself if it has none). The values are the fallback's (the same ops on the same
    inputs); what changes is the call boundary: a region's inputs and intermediates are
    freed after their last use inside it, as the unfused graph frees them, not when the
    whole region returns, and no custom-op dispatch runs per region."""
    calls = [n for n in gm.graph.nodes if n.target is FUSED_OP]
    if not calls:
        return gm
    graph, remap = _graph_copy(gm)
    for call in calls:
        node = remap[call]
        key, inputs = node.args
        body = region(key).gm.graph
        places = [p for p in body.nodes if p.op == "placeholder"]
        with graph.inserting_before(node):
            outs = graph.graph_copy(body, dict(zip(places, inputs)))
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(outs[user.args[1]])
                graph.erase_node(user)
            else:  # the list itself (a pipeline program returns it whole): the same values
                user.args, user.kwargs = fx.node.map_aggregate(
                    (user.args, user.kwargs), lambda a: list(outs) if a is node else a)
        graph.erase_node(node)
    graph.lint()
    return fx.GraphModule(gm, graph)
