"""Built-in example models: small, randomly initialised, no downloads.

Each factory returns an `Example`: the model, a global batch and the loss function.
Names are accepted by the CLI (`autopar trace gpt2-tiny`). Hugging Face models are
built from configs with `use_cache=False` and dropout off (so parity is exact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


class ModelSpecError(KeyError):
    """A model name or `pkg.module:factory` that names no model; the message says which
    names would work. A KeyError (a name not found), printed as its message."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass
class Example:
    model: torch.nn.Module
    batch: tuple[torch.Tensor, ...]  # one global batch (the example inputs)
    loss_fn: Callable[..., torch.Tensor] | None
    description: str
    # step -> a global batch with something to learn (the loss falls as it trains)
    data: Callable[[int], tuple[torch.Tensor, ...]] | None = None

    def batches(self, steps: int, start: int = 0) -> list[tuple[torch.Tensor, ...]]:
        if self.data is None:
            return [self.batch] * steps
        return [self.data(start + k) for k in range(steps)]


def progression_tokens(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """Token sequences that count up by a per-sequence stride (mod vocab): a causal LM
    learns to continue them, so the demo's loss visibly falls."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 4, (batch, 1), generator=gen)
    return (start + stride * torch.arange(seq)) % vocab


def causal_lm_loss(output, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a causal LM's logits against its own input ids."""
    logits = output.logits if hasattr(output, "logits") else output
    logits = logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))


def gpt2(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256, batch: int = 8,
         seq: int = 32, seed: int = 0, dropout: float = 0.0, attention: str = "sdpa") -> Example:
    """`dropout`: the embedding, residual and attention dropout probabilities (0: none, so
    parity with eager PyTorch does not depend on random draws). `attention`: transformers'
    attn_implementation ("sdpa", its default, or "eager": matmul, softmax, matmul)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                        n_positions=max(seq, 64), use_cache=False, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
                        attn_implementation=attention)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, vocab, (batch, seq))
    return Example(model, (ids,), causal_lm_loss,
                   f"GPT-2 (transformers), {layers} layers, hidden {hidden}, tied embeddings",
                   lambda step: (progression_tokens(batch, seq, vocab, seed + 1 + step),))


def llama(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 256,
          batch: int = 8, seq: int = 32, seed: int = 0) -> Example:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden,
                         intermediate_size=hidden * 2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=max(seq, 64), use_cache=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (batch, seq))
    return Example(model, (ids,), causal_lm_loss,
                   f"Llama (transformers), {layers} layers, hidden {hidden}, "
                   f"grouped-query attention {heads}/{kv_heads}",
                   lambda step: (progression_tokens(batch, seq, vocab, seed + 1 + step),))


def neox_config(layers: int, hidden: int, heads: int, vocab: int, positions: int,
                attention: str = "eager", dropout: float = 0.0, tied: bool = False):
    """GPT-NeoX (transformers) as a sequential pre-norm GPT (`use_parallel_residual=False`,
    GELU MLP of 4 x hidden): its fused q/k/v is laid out per head, as Megatron-LM's is.
    `attention`: "eager" (matmul, softmax, matmul) or "sdpa"; `dropout`: attention and
    residual; `tied`: input and output embeddings shared."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=layers,
                         intermediate_size=4 * hidden, vocab_size=vocab,
                         max_position_embeddings=positions, use_parallel_residual=False,
                         attention_dropout=dropout, hidden_dropout=dropout,
                         tie_word_embeddings=tied, use_cache=False,
                         attn_implementation=attention, bos_token_id=0, eos_token_id=0)


def neox(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256, batch: int = 8,
         seq: int = 32, seed: int = 0, attention: str = "eager",
         dropout: float = 0.0) -> Example:
    """A GPT-NeoX of `neox_config` (untied embeddings; `dropout`: attention and residual,
    0 so that parity with eager PyTorch does not depend on random draws)."""
    from transformers import GPTNeoXForCausalLM

    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(neox_config(layers, hidden, heads, vocab, max(seq, 64), attention,
                                           dropout=dropout))
    ids = torch.randint(0, vocab, (batch, seq))
    return Example(model, (ids,), causal_lm_loss,
                   f"GPT-NeoX (transformers), {layers} layers, hidden {hidden}, {attention} "
                   "attention",
                   lambda step: (progression_tokens(batch, seq, vocab, seed + 1 + step),))


class MLP(torch.nn.Module):
    def __init__(self, sizes: tuple[int, ...] = (32, 64, 64, 8)):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def sine_regression_loss(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Regress sin of the first output-width features of the input (targets need no
    extra input: the model and loss_fn both receive exactly the step's inputs)."""
    return F.mse_loss(output, torch.sin(x[:, :output.shape[-1]]))


def mlp(batch: int = 16, seed: int = 0) -> Example:
    torch.manual_seed(seed)
    model = MLP()
    x = torch.randn(batch, 32)
    return Example(model, (x,), sine_regression_loss, "3-layer MLP regressing sin(x)",
                   lambda step: (torch.randn(batch, 32,
                                             generator=torch.Generator().manual_seed(seed + 1 + step)),))


class CTR(torch.nn.Module):
    """A DLRM-style click-through-rate model: each sparse field's multi-hot ids through
    its own EmbeddingBag (sum), the dense features through a bottom MLP, all of them
    concatenated into a top MLP that gives one logit per example."""

    def __init__(self, fields: int = 4, rows: int = 10_000, dim: int = 16, dense: int = 13,
                 hidden: int = 64, tables_on: str = "cpu"):
        super().__init__()
        # tables_on="meta": the tables exist only on parameter servers, which make them
        self.tables = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(rows, dim, mode="sum", device=tables_on)
            for _ in range(fields))
        self.bottom = torch.nn.Sequential(torch.nn.Linear(dense, dim), torch.nn.ReLU())
        self.top = torch.nn.Sequential(torch.nn.Linear(dim * (fields + 1), hidden),
                                       torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        pooled = [table(sparse[:, f]) for f, table in enumerate(self.tables)]
        return self.top(torch.cat(pooled + [self.bottom(dense)], 1)).squeeze(1)


def ctr_loss(logits: torch.Tensor, sparse: torch.Tensor, dense: torch.Tensor,
             labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, labels)


def criteo_like(batch: int, fields: int, rows: int, hot: int, seed: int,
                dense: int = 13) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A synthetic Criteo-like batch: per field `hot` ids with a power-law frequency
    (id rank r drawn with probability ~ 1/r, then hashed over the table as Criteo's
    features are), 13 dense features, and labels from a planted per-id score, so a
    model that learns its rows lowers the loss."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(batch, fields, hot, generator=gen, dtype=torch.float64)
    rank = torch.floor(torch.pow(float(rows), u)).long() - 1  # log-uniform: P(r) ~ 1/r
    field = torch.arange(fields).view(1, fields, 1)
    ids = (rank * 2654435761 + field * 97_003) % rows
    x = torch.randn(batch, dense, generator=gen)
    score = torch.sin(ids.double() * 12.9898).float().sum((1, 2)) + x[:, 0]
    labels = torch.bernoulli(torch.sigmoid(score), generator=gen)
    return ids, x, labels


def ctr(fields: int = 4, rows: int = 10_000, dim: int = 16, hot: int = 3, batch: int = 64,
        seed: int = 0, tables_on: str = "cpu") -> Example:
    torch.manual_seed(seed)
    model = CTR(fields, rows, dim, tables_on=tables_on)
    return Example(model, criteo_like(batch, fields, rows, hot, seed), ctr_loss,
                   f"CTR model: {fields} EmbeddingBag tables of {rows:,} x {dim}, an MLP; "
                   f"synthetic Criteo-like batches of {batch}",
                   lambda step: criteo_like(batch, fields, rows, hot, seed + 1 + step))


# Small sizes for any transformers architecture; configs map these standard names to
# their own (GPT-2's n_embd, ...) through `attribute_map`. Dropout off for exact parity.
_TINY_HF = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, rotary_dim=8,
                use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, dropout=0.0,
                attention_dropout=0.0, hidden_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0)


def hf_tiny(model_type: str, batch: int = 8, seq: int = 32, seed: int = 0,
            **config: Any) -> Example:
    """A tiny randomly initialised model of any transformers architecture, by its config
    name ("qwen2", "mistral", "gpt_neox", "bert", ...), trained as a causal LM; `config`
    overrides the tiny sizes (num_key_value_heads=4, ...)."""
    import transformers

    _check_model_type(model_type)
    if config:
        default = transformers.AutoConfig.for_model(model_type)
        known = {**default.to_dict(), **default.attribute_map}
        unknown = sorted(set(config) - set(known))
        if unknown:
            import difflib

            near = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ModelSpecError(f"{model_type!r} configs have no field {unknown[0]!r}{hint}: "
                                 f"name a field of transformers' {model_type} config")
        # a field named by its own name (GPT-2's n_embd) replaces the tiny default given
        # under its alias (hidden_size), which the config would otherwise apply last
        given = {default.attribute_map.get(k, k) for k in config}
        tiny = {k: v for k, v in _TINY_HF.items() if default.attribute_map.get(k, k) not in given}
    else:
        tiny = _TINY_HF
    config = transformers.AutoConfig.for_model(model_type, **{**tiny, **config})
    torch.manual_seed(seed)
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM):
        if type(config) in auto._model_mapping:
            model = auto.from_config(config)
            break
    else:
        raise KeyError(f"transformers has no causal or masked LM head for {model_type!r}")
    vocab = config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq))
    return Example(model, (ids,), causal_lm_loss,
                   f"{type(model).__name__} (transformers, tiny config: 2 layers, hidden 64)",
                   lambda step: (progression_tokens(batch, seq, vocab, seed + 1 + step),))


EXAMPLES: dict[str, Callable[..., Example]] = {
    "gpt2-tiny": gpt2,
    "gpt2-small4": lambda **kw: gpt2(**{"layers": 4, "hidden": 256, "heads": 8, "vocab": 50257,
                                        "batch": 16, "seq": 128, **kw}),
    "llama-tiny": llama,
    "llama-small4": lambda **kw: llama(**{"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4,
                                          "vocab": 32000, "batch": 16, "seq": 128, **kw}),
    "neox-small4": lambda **kw: neox(**{"layers": 4, "hidden": 256, "heads": 8, "vocab": 32000,
                                        "batch": 16, "seq": 128, **kw}),
    "mlp": mlp,
    "ctr": ctr,
}


def load_example(name: str, **overrides) -> Example:
    """A built-in example, or a tiny model of the transformers architecture `name`."""
    if name in EXAMPLES:
        return EXAMPLES[name](**overrides)
    _check_example_name(name)
    return hf_tiny(name, **overrides)


def _check_example_name(name: str) -> None:
    """A name close to a built-in example's is taken as a typo of it; any other must be
    a transformers model type."""
    import difflib

    near = difflib.get_close_matches(name, EXAMPLES, n=1, cutoff=0.8)
    if near:
        raise ModelSpecError(f"no built-in example {name!r} (did you mean {near[0]!r}?); "
                             f"built-in: {', '.join(EXAMPLES)}")
    _check_model_type(name)


def _check_model_type(model_type: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        import difflib

        near = difflib.get_close_matches(model_type, CONFIG_MAPPING_NAMES, n=3)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise ModelSpecError(f"{model_type!r} is neither a built-in example "
                             f"({', '.join(EXAMPLES)}) nor a transformers model type{hint}")


def check_model_spec(spec: str) -> None:
    """Raise ModelSpecError where load_model_spec(spec) would for its name, without
    building the model: a `pkg.module:factory` is imported and looked up, any other
    name must be a built-in example or a transformers model type."""
    if ":" in spec:
        _factory(spec)
    elif spec not in EXAMPLES:
        _check_example_name(spec)


def _factory(spec: str):
    import importlib

    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ModelSpecError(f"cannot load model factory {spec!r}: {exc}") from exc


def load_model_spec(spec: str, **overrides) -> Example:
    """`pkg.module:factory` (returning an Example or (model, batch, loss_fn)) or a
    built-in example name."""
    if ":" not in spec:
        return load_example(spec, **overrides)
    made = _factory(spec)(**overrides)
    if isinstance(made, Example):
        return made
    if isinstance(made, tuple) and len(made) == 3:
        model, batch, loss_fn = made
        batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        return Example(model, batch, loss_fn, f"{spec}")
    raise TypeError(f"{spec} returned {type(made).__name__}; return an autopar.examples.Example "
                    "or a (model, example_batch, loss_fn) tuple")
