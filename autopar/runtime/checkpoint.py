"""Atomic, verified checkpoints of a rank's named tensors and optimizer state.

A checkpoint is a directory written by torch.distributed.checkpoint (DCP) plus
``autopar_manifest.json``: the caller's manifest (``manifest["tensors"]`` maps
each name to ``{"shape": [...], "dtype": "float32"}``, see `describe_tensors`;
layout, world size and version ride along unchecked), a record of the optimizer
state's structure, and a SHA-256 of every file DCP wrote.

Every rank calls `save_checkpoint` / `load_checkpoint` collectively when a
process group is initialised; without one they run as a single process. Ranks may
hold different subsets of the manifest's tensors and of the optimizer's parameters
(a pipeline stage holds its own layers): each rank's subset is checked against the
manifest, their union must cover it, and the optimizer record is the union of every
rank's. Per-rank values (each rank's RNG state) are saved under the rank's number and
restored only into the same layout and world size.

    save: rank 0 picks a random suffix (broadcast) -> all ranks write into
          <path>.tmp-<suffix> -> barrier -> rank 0 hashes the files, writes the
          manifest last, renames <path> to <path>.old-<suffix>, renames the tmp
          dir to <path>, deletes the old one.
    load: rank 0 checks manifest, checksums and names/shapes/dtypes -> all
          ranks load into fresh tensors -> copied into the caller's tensors only
          once the whole load has succeeded.

Rank 0's verdict is broadcast, so every rank returns or raises `CheckpointError`
together. A save killed before its final rename leaves <path> untouched; one
killed between the two renames is finished by the next save or load (the tmp
dir holds a manifest only once it is complete).

Optimizer state is created lazily at the first step, so a fresh optimizer has
nothing to load into. The manifest therefore records each parameter's state
keys with their shapes and dtypes (or that the value is a plain object), and the
load template is built from that record: a state tensor shaped like its
parameter is allocated with ``empty_like(param)`` (so it inherits a DTensor's
placements under sharded layouts and DCP reshards it), any other (the 0-d
``step``) as a plain tensor.

DCP behaviour callers must know:
- plain (non-DTensor) tensors count as replicated: DCP writes one copy, from a
  rank its dedup picks, so they must be equal on every rank;
- non-tensor values (hyperparameters, a float ``step``) are pickled from rank 0
  only and unpickled by every rank on load;
- the checkpoint directory must be on a filesystem that every rank sees;
- rank 0 alone hashes every file, on save and again on load: one more full read;
- under NCCL, call torch.cuda.set_device first (rank 0's verdicts are broadcast
  as objects).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import secrets
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.api import CheckpointException

from autopar.runtime.mesh import new_group

MANIFEST_FILE = "autopar_manifest.json"
_FORMAT = 2  # 2: parameter groups' names in the record, per-rank values
_TMP = ".tmp-"
_OLD = ".old-"
_MAX_LISTED = 20
_T = TypeVar("_T")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank alike."""


# ---------------------------------------------------------------- optimizer state by name


def _group_names(optimizer: torch.optim.Optimizer, param_names: dict[int, str]) -> list[list[str]]:
    """The optimizer's parameters as names, group by group, in its own order."""
    groups = []
    for group in optimizer.param_groups:
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in param_names]
        if missing:
            raise CheckpointError(f"optimizer parameters of shapes {missing} have no name in param_names")
        groups.append([param_names[id(p)] for p in group["params"]])
    return groups


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, param_names: dict[int, str]) -> dict:
    """``optimizer.state_dict()`` with its integer parameter ids replaced by names.

    The tensors are the optimizer's own (not copies).
    """
    # NOTE: state_dict() numbers parameters in param_groups order, as _group_names lists them.
    by_index = [name for group in _group_names(optimizer, param_names) for name in group]
    raw = optimizer.state_dict()
    state = {by_index[i]: dict(entries) for i, entries in raw["state"].items()}
    groups = [{**group, "params": [by_index[i] for i in group["params"]]} for group in raw["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, param_names: dict[int, str], state: dict) -> None:
    """Load a name-keyed optimizer state (see `optimizer_state_by_name`) into ``optimizer``."""
    groups = _group_names(optimizer, param_names)
    problems = _group_mismatches([list(g["params"]) for g in state["param_groups"]], groups)
    if problems:
        raise CheckpointError("optimizer state does not fit this optimizer:\n  " + "\n  ".join(problems))
    index = {name: i for i, name in enumerate(name for group in groups for name in group)}
    optimizer.load_state_dict(
        {
            "state": {index[name]: dict(entries) for name, entries in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
        }
    )


def _group_mismatches(saved: list[list[str]], wanted: list[list[str]]) -> list[str]:
    if len(saved) != len(wanted):
        return [f"{len(saved)} parameter groups in the checkpoint, {len(wanted)} in this optimizer"]
    problems = []
    for i, (have, want) in enumerate(zip(saved, wanted)):
        if have == want:
            continue
        missing = [n for n in want if n not in have]
        unexpected = [n for n in have if n not in want]
        details = []
        if missing:
            details.append("missing from the checkpoint: " + _listing(missing))
        if unexpected:
            details.append("not in this optimizer: " + _listing(unexpected))
        problems.append(f"parameter group {i}: " + ("; ".join(details) or "same parameters in a different order"))
    return problems


# ---------------------------------------------------------------- manifests


def describe_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """``manifest["tensors"]`` for these tensors: global shape (a DTensor's too) and dtype."""
    return {name: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for name, t in tensors.items()}


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _listing(names: list[str]) -> str:
    more = len(names) - _MAX_LISTED
    return ", ".join(names[:_MAX_LISTED]) + (f" and {more} more" if more > 0 else "")


def _tensor_mismatches(saved: dict, current: dict, saved_where: str, current_where: str) -> list[str]:
    """Lines naming tensors missing, unexpected or different between two ``manifest["tensors"]``."""
    lines = []
    missing = [name for name in current if name not in saved]
    unexpected = [name for name in saved if name not in current]
    if missing:
        lines.append(f"not {saved_where}: " + _listing(missing))
    if unexpected:
        lines.append(f"{saved_where} but not {current_where}: " + _listing(unexpected))
    for name in (n for n in current if n in saved):
        old, new = saved[name], current[name]
        if list(old["shape"]) != list(new["shape"]):
            lines.append(f"{name}: shape {tuple(old['shape'])} {saved_where}, {tuple(new['shape'])} {current_where}")
        if _dtype_name(old["dtype"]) != _dtype_name(new["dtype"]):
            lines.append(
                f"{name}: dtype {_dtype_name(old['dtype'])} {saved_where}, {_dtype_name(new['dtype'])} {current_where}"
            )
    more = len(lines) - _MAX_LISTED
    return lines[:_MAX_LISTED] + ([f"and {more} more"] if more > 0 else [])


def _describe_optimizer(state: dict) -> dict:
    """The structure of a name-keyed optimizer state, enough to rebuild a load template:
    every rank's, merged (collective). A parameter group lists the union of the ranks'
    parameters in it."""

    def describe(value: Any) -> dict:
        if isinstance(value, torch.Tensor):
            return {"shape": list(value.shape), "dtype": _dtype_name(value.dtype)}
        return {"object": type(value).__name__}

    mine = {
        "state": {name: {k: describe(v) for k, v in entries.items()} for name, entries in state["state"].items()},
        "param_groups": [{"params": list(g["params"]), "keys": list(g)} for g in state["param_groups"]],
    }
    ranks = _gather(mine)
    counts = {len(r["param_groups"]) for r in ranks}
    if len(counts) > 1:
        raise CheckpointError(f"the ranks' optimizers have different numbers of parameter groups: {sorted(counts)}")
    merged = {"state": {}, "param_groups": [{"params": [], "keys": g["keys"]} for g in ranks[0]["param_groups"]]}
    for r in ranks:
        for name, entries in r["state"].items():
            merged["state"].setdefault(name, entries)
        for group, theirs in zip(merged["param_groups"], r["param_groups"]):
            group["params"] += [n for n in theirs["params"] if n not in group["params"]]
    return merged


def _manifest_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read_record(path: Path) -> dict:
    """The saved manifest record; guards against a damaged manifest by its own digest."""
    file = path / MANIFEST_FILE
    if not file.is_file():
        raise CheckpointError(f"no autopar checkpoint at {path}")
    try:
        record = json.loads(file.read_text())
        digest = record.pop("manifest_sha256")
    except (ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupted: {MANIFEST_FILE} cannot be read ({e})") from e
    if digest != _manifest_digest(record):
        raise CheckpointError(f"checkpoint {path} is corrupted: {MANIFEST_FILE} has changed since it was saved")
    return record


def _write_record(directory: Path, record: dict) -> None:
    """Written last and by rename: a tmp dir with a manifest is a complete checkpoint."""
    partial = directory / (MANIFEST_FILE + ".partial")
    with open(partial, "w") as f:
        json.dump({**record, "manifest_sha256": _manifest_digest(record)}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, directory / MANIFEST_FILE)


# ---------------------------------------------------------------- files


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _checksums(directory: Path) -> dict[str, str]:
    files = sorted(f for f in directory.rglob("*") if f.is_file() and f.name != MANIFEST_FILE)
    return {f.relative_to(directory).as_posix(): _sha256(f) for f in files}


def _siblings(path: Path, tag: str) -> list[Path]:
    found = path.parent.glob(glob.escape(path.name + tag) + "*")
    return sorted((p for p in found if p.is_dir()), key=lambda p: p.stat().st_mtime)


def _fsync_dir(directory: Path) -> None:
    """Makes the renames durable, not just visible."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish_interrupted_swap(path: Path) -> None:
    """A save killed between its two renames left no <path>: put a checkpoint back there."""
    if path.exists():
        return
    complete = [d for d in _siblings(path, _TMP) if (d / MANIFEST_FILE).is_file()]
    previous = _siblings(path, _OLD)
    if complete or previous:
        os.rename((complete or previous)[-1], path)


def _prepare_save(path: Path, record: dict) -> str:
    """Rank 0, before writing: returns the tmp suffix every rank will use."""
    _check_record(record)
    _finish_interrupted_swap(path)
    if path.exists() and not (path / MANIFEST_FILE).is_file() and (path.is_file() or any(path.iterdir())):
        raise CheckpointError(f"refusing to replace {path}: it exists and is not an autopar checkpoint")
    # NOTE: leftovers of killed saves; assumes no other job saves to the same path concurrently.
    for stale in _siblings(path, _TMP) + _siblings(path, _OLD):
        shutil.rmtree(stale, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    return secrets.token_hex(8)


def _publish(tmp: Path, path: Path, suffix: str, record: dict) -> None:
    """Rank 0, after every rank has written: seal the tmp dir and swap it into place."""
    _write_record(tmp, {**record, "files": _checksums(tmp)})
    old = path.with_name(path.name + _OLD + suffix)
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- collectives


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _gather(obj: _T) -> list[_T]:
    """Every rank's `obj`, in rank order (collective)."""
    if not _distributed():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _agree(problems: list[str], what: str) -> None:
    """Raise CheckpointError on every rank if any rank found a problem (collective)."""
    found = [(r, p) for r, lines in enumerate(_gather(problems)) for p in lines]
    if found:
        lines = [f"rank {r}: {p}" if _distributed() else p for r, p in found]
        more = len(lines) - _MAX_LISTED
        lines = lines[:_MAX_LISTED] + ([f"and {more} more"] if more > 0 else [])
        raise CheckpointError(what + ":\n  " + "\n  ".join(lines))


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _is_rank0() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _on_rank0(fn: Callable[[], _T]) -> _T:
    """Run ``fn`` on rank 0 only; every rank gets its result, or raises its error."""
    result, error, cause = None, None, None
    if _is_rank0():
        try:
            result = fn()
        except Exception as e:  # any failure must reach the other ranks, or they hang
            error, cause = (str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"), e
    if _distributed():
        box = [(result, error)]
        dist.broadcast_object_list(box, src=0)
        result, error = box[0]
    if error is not None:
        raise CheckpointError(error) from cause
    return result


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns whenever it runs without a process group, which is a supported mode here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dcp_failure(error: BaseException) -> str:
    """One line per failed rank instead of DCP's full tracebacks."""
    if not isinstance(error, CheckpointException):
        return f"{type(error).__name__}: {error}"
    return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(error.failures.items()))


# ---------------------------------------------------------------- the DCP state dict


def _key(*parts: str | int) -> str:
    return ".".join(map(str, parts))


def _flat_state_dict(tensors: dict[str, torch.Tensor], optimizer_state: dict | None,
                     per_rank: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """One flat dict, so that DCP's keys are ours and loading never depends on its flattening
    rules. A group's parameter names are in the record (ranks differ), not here."""
    flat: dict[str, Any] = {_key("model", name): t for name, t in tensors.items()}
    if optimizer_state is not None:
        for name, entries in optimizer_state["state"].items():
            flat.update({_key("optim.state", name, key): value for key, value in entries.items()})
        for i, group in enumerate(optimizer_state["param_groups"]):
            flat.update({_key("optim.param_groups", i, key): value for key, value in group.items()
                         if key != "params"})
    flat.update({_key("rank", _rank(), name): t for name, t in (per_rank or {}).items()})
    return flat


def _load_planner() -> DefaultLoadPlanner:
    # NOTE: with flatten_sharded_tensors the planner stores the non-tensor values it reads
    # into a copy of our dict, and they are lost (hyperparameters came back as None in testing).
    return DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _optimizer_template(record: dict, tensors: dict[str, torch.Tensor], groups: list[list[str]]) -> dict:
    """Empty name-keyed optimizer state shaped as the saved one (see the module docstring),
    for the parameters of this rank's `groups` only."""
    mine = {name for group in groups for name in group}

    def empty(spec: dict, param: torch.Tensor | None) -> Any:
        if "object" in spec:
            return None  # DCP replaces non-tensor values wholesale on load
        shape, dtype = tuple(spec["shape"]), getattr(torch, spec["dtype"])
        if param is not None and tuple(param.shape) == shape:
            return torch.empty_like(param, dtype=dtype)
        return torch.empty(shape, dtype=dtype)

    return {
        "state": {
            name: {key: empty(spec, tensors.get(name)) for key, spec in entries.items()}
            for name, entries in record["state"].items() if name in mine
        },
        "param_groups": [{key: None for key in group["keys"]} for group in record["param_groups"]],
    }


def _unflatten_optimizer(flat: dict[str, Any], record: dict, groups: list[list[str]]) -> dict:
    """The inverse of `_flat_state_dict` for the optimizer part of this rank's `groups`,
    guided by the saved record."""
    mine = {name for group in groups for name in group}
    state = {}
    for name, entries in record["state"].items():
        if name in mine:
            state[name] = {key: flat[_key("optim.state", name, key)] for key in entries}
    loaded = []
    for i, (group, names) in enumerate(zip(record["param_groups"], groups)):
        loaded.append({key: list(names) if key == "params" else flat[_key("optim.param_groups", i, key)]
                       for key in group["keys"]})
    return {"state": state, "param_groups": loaded}


# ---------------------------------------------------------------- save / load


def save_checkpoint(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], optimizer_state: dict | None, manifest: dict,
    extra: dict | None = None, per_rank: dict[str, torch.Tensor] | None = None, background: bool = False,
) -> PendingSave | None:
    """Atomically replace the checkpoint at ``path`` (see the module docstring). Collective.

    ``tensors``: this rank's named tensors, a subset of ``manifest["tensors"]`` (the
    ranks' union must cover it). ``extra``: JSON-serialisable state saved in the
    manifest record with the tensors (the data-block master's queues: a checkpoint holds
    the data position with the weights); `read_extra` returns it. ``per_rank``: tensors
    of this rank alone (its RNG state), saved under its rank number.

    ``background``: copy the tensors (DCP's staging) and return a `PendingSave` at once;
    a thread writes the files (torch.distributed.checkpoint.async_save, over a gloo group
    of its own so that its collectives never meet the step's) and then publishes the
    checkpoint as a synchronous save would. Call its `wait()` on every rank before the
    next save: it raises CheckpointError on every rank if the save failed."""
    path = Path(path)
    _agree(_subset_mismatches(tensors, manifest), "the manifest does not describe the tensors being saved")
    record = {"format": _FORMAT, "manifest": manifest, "extra": extra or {},
              "per_rank": {"world_size": _world(), "names": sorted(per_rank or {})}}
    if optimizer_state is not None:
        record["optimizer"] = _describe_optimizer(optimizer_state)
    suffix = _on_rank0(lambda: _prepare_save(path, record))
    tmp = path.with_name(path.name + _TMP + suffix)
    flat = _flat_state_dict(tensors, optimizer_state, per_rank)
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    if background:
        group = _background_group()
        with _quiet_single_process():
            future = dcp.async_save(flat, storage_writer=FileSystemWriter(tmp), planner=planner,
                                    process_group=group)
        return PendingSave(path, lambda: _finish_background(future, path, tmp, suffix, record, group))
    try:
        with _quiet_single_process():
            dcp.save(flat, storage_writer=FileSystemWriter(tmp), planner=planner)
    # NOTE: CheckpointException derives from BaseException; DCP raises it on every rank
    # when any rank fails to write.
    except (Exception, CheckpointException) as e:
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"saving checkpoint {path} failed, the previous one there is untouched: {_dcp_failure(e)}"
        ) from e
    if _distributed():
        dist.barrier()
    _on_rank0(lambda: _publish(tmp, path, suffix, record))
    return None


class PendingSave:
    """A checkpoint being written in the background (`save_checkpoint(background=True)`)."""

    def __init__(self, path: Path, finish: Callable[[], str | None]):
        self.path = path
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, args=(finish,), daemon=True,
                                        name=f"autopar-save-{path.name}")
        self._thread.start()

    def _run(self, finish: Callable[[], str | None]) -> None:
        self._error = finish()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the checkpoint is published (or failed: CheckpointError, on every rank)."""
        self._thread.join()
        if self._error is not None:
            raise CheckpointError(self._error)


_BACKGROUND_GROUP: list = []


def _background_group():
    """A gloo group of every rank for background saves (created once, collectively)."""
    if not _distributed():
        return None
    if not _BACKGROUND_GROUP:
        _BACKGROUND_GROUP.append(new_group(backend="gloo"))
    return _BACKGROUND_GROUP[0]


def _finish_background(future, path: Path, tmp: Path, suffix: str, record: dict, group) -> str | None:
    """In the save's thread: wait for this rank's files, agree with the other ranks over
    `group`, and let rank 0 publish. Returns the error every rank reports, or None."""
    try:
        future.result()
        mine = None
    except (Exception, CheckpointException) as e:
        mine = _dcp_failure(e)
    verdicts = [mine]
    if _distributed():
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, mine, group=group)
    failed = [f"rank {r}: {v}" for r, v in enumerate(verdicts) if v is not None]
    error = None
    if failed:
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        error = f"saving checkpoint {path} failed, the previous one there is untouched: " + "; ".join(failed)
    elif _is_rank0():
        try:
            _publish(tmp, path, suffix, record)
        except Exception as e:  # every rank must hear of it
            error = f"publishing checkpoint {path} failed: {type(e).__name__}: {e}"
    if _distributed():
        box = [error]
        dist.broadcast_object_list(box, src=0, group=group)
        error = box[0]
    return error


def _subset_mismatches(tensors: dict[str, torch.Tensor], manifest: dict) -> list[str]:
    """This rank's tensors against the manifest, and (collective) the ranks' union against it."""
    described = manifest.get("tensors", {})
    mine = describe_tensors(tensors)
    lines = _tensor_mismatches({n: d for n, d in described.items() if n in mine}, mine,
                               "in the manifest", "in the tensors")
    held = set().union(*_gather(sorted(mine)))
    unsaved = [name for name in described if name not in held]
    if unsaved and _is_rank0():
        lines.append("in the manifest but held by no rank: " + _listing(unsaved))
    return lines


def _check_record(record: dict) -> None:
    """The manifest can be written, or a later load would misjudge it."""
    try:
        json.dumps(record)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the checkpoint manifest must be JSON-serialisable: {e}") from e


def load_checkpoint(
    path: str | os.PathLike,
    tensors: dict[str, torch.Tensor],
    manifest: dict,
    optimizer_state_template: dict | None,
    state_like: dict[str, torch.Tensor] | None = None,
    per_rank: dict[str, torch.Tensor] | None = None,
) -> dict | None:
    """Load ``path`` into ``tensors`` in place and return the name-keyed optimizer state. Collective.

    ``tensors``: this rank's subset of the manifest's (as in `save_checkpoint`).
    Only the template's ``param_groups[i]["params"]`` names are used (each must be in
    the saved group i, and the ranks' union must equal it); its state may be empty.
    Without a template no optimizer state is read and None is returned. On any error
    nothing is changed. ``state_like``: per parameter name, the tensor its state tensors
    are shaped and placed like (default ``tensors``; a ZeRO step's optimizer updates
    blocks). ``per_rank``: this rank's own tensors, loaded in place only when the
    checkpoint was saved in the same layout and world size (else left as they are).
    """
    path = Path(path)
    record = _on_rank0(lambda: _verify(path, manifest, optimizer_state_template is not None))
    groups = None
    if optimizer_state_template is not None:
        groups = [list(g["params"]) for g in optimizer_state_template["param_groups"]]
        saved = [g["params"] for g in record["optimizer"]["param_groups"]]
        every = _gather(groups)
        _agree(_union_mismatches(saved, every) if _is_rank0() else [],
               f"checkpoint {path} does not match this optimizer")
    same_ranks = (record["manifest"].get("layout") == manifest.get("layout")
                  and record.get("per_rank", {}).get("world_size") == _world())
    own = {n: t for n, t in (per_rank or {}).items() if same_ranks and n in record["per_rank"]["names"]}
    fresh = {name: torch.empty_like(t) for name, t in tensors.items()}
    fresh_own = {name: torch.empty_like(t) for name, t in own.items()}
    optimizer = None if groups is None else _optimizer_template(
        record["optimizer"], tensors if state_like is None else state_like, groups)
    flat = _flat_state_dict(fresh, optimizer, fresh_own)
    try:
        with _quiet_single_process():
            dcp.load(flat, storage_reader=FileSystemReader(path), planner=_load_planner())
    except (Exception, CheckpointException) as e:  # raised on every rank, as in save
        raise CheckpointError(f"loading checkpoint {path} failed, nothing was changed: {_dcp_failure(e)}") from e
    with torch.no_grad():
        for name, t in tensors.items():
            t.copy_(fresh[name])
        for name, t in own.items():
            t.copy_(fresh_own[name])
    return None if optimizer is None else _unflatten_optimizer(flat, record["optimizer"], groups)


def _union_mismatches(saved: list[list[str]], ranks: list[list[list[str]]]) -> list[str]:
    """Each rank's parameter groups against the saved ones: rank r's group i must lie in
    saved group i, and the ranks' groups together must hold all of it."""
    lines = []
    for r, groups in enumerate(ranks):
        if len(groups) != len(saved):
            lines.append(f"{len(saved)} parameter groups in the checkpoint, {len(groups)} in the "
                         f"optimizer" + (f" of rank {r}" if len(ranks) > 1 else ""))
            continue
        for i, (want, have) in enumerate(zip(groups, saved)):
            missing = [n for n in want if n not in have]
            if missing:
                lines.append(f"parameter group {i}: missing from the checkpoint: " + _listing(missing))
    if lines:
        return lines
    for i, have in enumerate(saved):
        held = {n for groups in ranks for n in groups[i]}
        unexpected = [n for n in have if n not in held]
        if unexpected:
            lines.append(f"parameter group {i}: not in this optimizer: " + _listing(unexpected))
    return lines


def read_extra(path: str | os.PathLike) -> dict:
    """The ``extra`` state saved with the checkpoint at ``path`` (its record is checked
    against its own digest). Collective."""
    return _on_rank0(lambda: _read_record(Path(path)).get("extra", {}))


def verify_intact(path: str | os.PathLike) -> dict:
    """The checkpoint at ``path`` is complete and unchanged since it was saved (its record
    against its digest, every file against its SHA-256); returns the record. Not
    collective: run on one rank, it raises CheckpointError naming what is wrong."""
    path = Path(path)
    _finish_interrupted_swap(path)
    record = _read_record(path)
    if record.get("format") != _FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {record.get('format')}; this autopar "
                              f"reads format {_FORMAT}")
    for name, digest in record["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is corrupted: {name} is missing")
        if _sha256(file) != digest:
            raise CheckpointError(f"checkpoint {path} is corrupted: {name} has changed since it was saved")
    return record


def _verify(path: Path, manifest: dict, with_optimizer: bool) -> dict:
    """Rank 0, before anything is read: the checkpoint is intact and fits the caller."""
    record = verify_intact(path)
    lines = _tensor_mismatches(record["manifest"]["tensors"], manifest["tensors"], "in the checkpoint", "in this model")
    if with_optimizer and "optimizer" not in record:
        lines.append("no optimizer state in the checkpoint")
    if lines:
        raise CheckpointError(f"checkpoint {path} does not match this model:\n  " + "\n  ".join(lines))
    return record
