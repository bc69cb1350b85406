"""The CLI's trace command and the AUTOPAR_LOGS switch."""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys

import pytest

from autopar import cli, logs


def test_trace_json_summary(capsys):
    assert cli.main(["trace", "gpt2-tiny", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameter_tensors"] == 28 and info["nodes_by_role"]["backward"] > 0
    assert info["flops_per_step"] > 0 and info["largest_activations"]


def test_trace_table_and_ir(capsys, tmp_path):
    ir = tmp_path / "ir.txt"
    assert cli.main(["trace", "mlp", "--ir", str(ir)]) == 0
    out = capsys.readouterr().out
    assert "ops by role" in out and "largest activations" in out
    assert "return (" in ir.read_text()


def test_trace_list_and_unknown_model(capsys):
    assert cli.main(["trace", "--list"]) == 0
    assert "llama-tiny" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="autopar trace: no built-in example 'gpt2-tny' "
                                         r"\(did you mean 'gpt2-tiny'\?\)"):
        cli.main(["trace", "gpt2-tny"])


def test_trace_user_factory(capsys):
    assert cli.main(["trace", "autopar.examples:mlp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameter_tensors"] == 6


def test_log_spec_parsing():
    assert logs.parse("passes,+runtime,-trace") == {
        "passes": logging.INFO, "runtime": logging.DEBUG, "trace": logging.ERROR}
    assert set(logs.parse("+all")) == set(logs.COMPONENTS)
    with pytest.raises(logs.LogSpecError, match="unknown component 'pass'"):
        logs.parse("pass")


@pytest.mark.slow
@pytest.mark.processes
def test_train_command_reports_progress_and_parity(tmp_path):
    cmd = [sys.executable, "-m", "autopar", "train", "mlp", "--dp", "2", "--steps", "3",
           "--parity", "--optimizer", "sgd", "--lr", "0.05", "--save", str(tmp_path / "ck")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 3/3" in done.stdout and "equal" in done.stdout
    assert "checkpoint saved" in done.stdout and (tmp_path / "ck").is_dir()


@pytest.mark.processes
@pytest.mark.parametrize("elastic", [False, True])
def test_a_layout_the_model_cannot_take_is_one_message_not_a_traceback_per_rank(elastic,
                                                                              tmp_path):
    """The layout passes the CLI's checks (its fields, the world size) and fails in each
    rank's compile: two blocks cannot make four stages. The run ends with that message
    and a failing status, without the ranks' or torchrun's tracebacks; the elastic run
    too, whose agent restarts its failed workers first (each refuses again)."""
    cmd = [sys.executable, "-m", "autopar", "train", "gpt2-tiny", "--nproc", "2", "--pp", "2",
           "--virtual-stages", "2", "--schedule", "interleaved", "--microbatches", "4",
           "--steps", "2"]
    if elastic:
        cmd += ["--elastic", "--checkpoint-dir", str(tmp_path / "ck"), "--max-restarts", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "autopar train: 4 pipeline stages (pp=2 x virtual_stages=2) but the model has 2 "
        "repeated blocks to cut between; use pp*virtual_stages <= 2"), done.stderr
    assert "Traceback" not in done.stderr + done.stdout, done.stderr


@pytest.mark.slow
@pytest.mark.processes
def test_train_command_plans_the_layout():
    cmd = [sys.executable, "-m", "autopar", "train", "gpt2-tiny", "--plan", "--nproc", "2",
           "--steps", "3", "--parity", "--optimizer", "sgd", "--lr", "0.05"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(planned)" in done.stdout and "step 3/3" in done.stdout and "equal" in done.stdout


def test_train_layout_flags():
    import autopar
    from autopar.cli import _train_layout, build_parser

    parse = build_parser().parse_args
    assert _train_layout(parse(["train", "mlp"])) == autopar.Layout(dp=2)
    layout = _train_layout(parse(["train", "gpt2-tiny", "--tp", "2", "--pp", "2",
                                  "--microbatches", "2", "--sequence-parallel"]))
    assert layout == autopar.Layout(tp=2, pp=2, microbatches=2, sequence_parallel=True)
    assert _train_layout(parse(["train", "mlp", "--plan"])) == autopar.Layout()
    with pytest.raises(autopar.LayoutError, match="--plan chooses the layout; drop --tp, --zero"):
        _train_layout(parse(["train", "mlp", "--plan", "--tp", "2", "--zero", "1"]))


@pytest.mark.parametrize("command", ["train", "estimate", "check", "bisect"])
@pytest.mark.parametrize("flags, words", [
    (["--local-sgd-overlap", "2", "--local-sgd-adaptive"],
     r"--local-sgd-adaptive and --local-sgd-overlap only with --local-sgd \(the averaging"),
    (["--dp", "2", "--local-sgd", "0"], r"--local-sgd \(the averaging period H, in steps\) must"),
    (["--dgc-topk", "sampled"], r"--dgc-topk only with --dgc \(the final sparsity"),
    (["--dp", "2", "--tp", "0"], "--tp must be a positive integer, got 0"),
])
def test_a_bad_layout_flag_is_named_by_its_flag(command, flags, words, capsys):
    """A layout built from flags names the flags the user typed, not the Layout fields they
    set (the message is the Layout's own otherwise); every layout flag is the field's name
    with dashes, which the rewrite relies on."""
    for action in actions_of(command):
        if action.dest in cli._LAYOUT_FLAGS:
            assert f"--{action.dest.replace('_', '-')}" in action.option_strings, action
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "gpt2-tiny", *flags])
    assert str(exc.value).startswith(f"autopar {command}: ")
    assert re.search(words, str(exc.value)), str(exc.value)
    assert "Layout." not in str(exc.value)


def actions_of(command: str) -> list[argparse.Action]:
    """The arguments of the CLI's `command`."""
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]._actions


def test_a_tiny_models_config_override_names_an_unknown_field():
    """hf_tiny's config overrides: a field the architecture's config does not have is
    refused, naming the nearest one (transformers would keep it as an unused attribute)."""
    from autopar.examples import hf_tiny

    with pytest.raises(KeyError, match="no field 'num_key_value_head'.*'num_key_value_heads'"):
        hf_tiny("phi3", num_key_value_head=4)
    assert hf_tiny("phi3", num_key_value_heads=4).model.config.num_key_value_heads == 4


def test_a_tiny_models_config_override_by_the_fields_own_name_wins():
    """GPT-2-style configs name the hidden size n_embd, with hidden_size an alias: the
    tiny default (given as hidden_size) must not override the user's n_embd."""
    from autopar.examples import hf_tiny

    config = hf_tiny("gpt_bigcode", n_embd=128, n_head=8).model.config
    assert (config.n_embd, config.n_head, config.hidden_size) == (128, 8, 128)
    assert hf_tiny("gpt2", hidden_size=96).model.config.n_embd == 96
