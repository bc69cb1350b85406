"""What checking that a step splits along the batch costs, against torch.export of the
same step (PyTorch's own trace, which every compile runs first), over transformers
families and model shapes; and the verdict on each.

For each model: export the step (model and loss) on one data-parallel rank's share of
the batch, then run the analysis (`passes/batch_split.py`) on the exported forward;
`--rounds` fresh exports and analyses, medians reported. The verdict column says the
loss's form over the batch (mean / sum), or the refusal; `assumed` counts the ops taken
as per sample with no rule that proves it (listed in the pass result).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/batch_split_cost.py \\
        --rounds 3 --json benchmarks/data/batch_split_cost.json

The analysis exports the step at a second batch size (TraceSource.resized) to tell
numbers made from the shard's size (`loss.sum() / x.shape[0]`) from constants: its time
includes that export. With `--one-sample` each rank's share is one sample, whose batch
dims of size 1 shapes cannot tell from broadcast ones: the analysis reads exports at two
and three samples instead (two more exports).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from autopar.compiler.ir.batch import Objective
from autopar.compiler.ir.trace import trace_source
from autopar.compiler.passes.batch_split import BatchSplitError, _analyse
from autopar.examples import EXAMPLES, hf_tiny

FAMILIES = ["gpt2", "llama", "qwen2", "qwen3", "phi3", "mistral", "mixtral", "qwen2_moe",
            "olmoe", "phimoe", "gemma", "gemma2", "gpt_neox", "gpt_bigcode", "gptj", "opt",
            "falcon", "bloom", "mpt", "codegen", "granite", "cohere", "starcoder2",
            "stablelm", "olmo", "nemotron", "persimmon", "biogpt", "xglm", "mamba", "gpt_oss",
            "bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta-v2",
            "megatron-bert"]
SHAPES = ["gpt2-small4", "llama-small4"]  # 4 layers, hidden 256, batch 16 x 128


def _measure(example, rounds: int, dp: int = 2, one_sample: bool = False) -> dict:
    objective, flat = Objective.from_example(example.batch, None, example.loss_fn)
    local = [t[: 1 if one_sample else t.shape[0] // dp] for t in flat]
    exports, analyses, verdict = [], [], None
    for _ in range(rounds):
        start = time.perf_counter()
        source = trace_source(example.model, local, objective, whole=flat)
        exports.append(time.perf_counter() - start)
        start = time.perf_counter()
        found = _analyse(source)
        analyses.append(time.perf_counter() - start)
        verdict = found
    export_s, analysis_s = statistics.median(exports), statistics.median(analyses)
    refused = isinstance(verdict, BatchSplitError)
    return {"export_s": round(export_s, 4), "analysis_s": round(analysis_s, 4),
            "ratio": round(analysis_s / export_s, 4),
            "verdict": "refused: " + str(verdict)[:160] if refused else verdict.form,
            "assumed": 0 if refused else len(verdict.assumed),
            "checked": refused or verdict.checked,
            "sizes_read": refused or not verdict.sizes_unread}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one-sample", action="store_true",
                    help="one sample a rank: the analysis exports two (module docstring)")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = {}
    for family in FAMILIES:
        rows[family] = _measure(hf_tiny(family, batch=8, seq=32), args.rounds,
                                one_sample=args.one_sample)
        print(family, rows[family], flush=True)
    for name in SHAPES:
        rows[name] = _measure(EXAMPLES[name](), args.rounds, one_sample=args.one_sample)
        print(name, rows[name], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
