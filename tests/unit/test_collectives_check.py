"""The pre-launch check of every rank's collectives (compiler/ir/collectives.py,
`autopar.check`): the programs of a correct layout pass; a program mutated on one rank
(two collectives swapped, a shape changed, one dropped) is refused, naming the rank,
the node and both operations."""

import pytest
import torch

import autopar
from autopar.compiler.ir.collectives import (
    CollectiveMismatch,
    check_collectives,
    group_members,
    program_collectives,
)
from autopar.compiler.lowering.lower import to_program
from autopar.examples import gpt2, llama


def test_groups_are_the_meshs_rows_and_columns():
    mesh = (("dp", 2), ("tp", 2))
    assert group_members(mesh, "tp") == [[0, 1], [2, 3]]
    assert group_members(mesh, "dp") == [[0, 2], [1, 3]]
    assert group_members((("dp", 2), ("pp", 2), ("tp", 2)), "pp") == \
        [[0, 2], [1, 3], [4, 6], [5, 7]]


@pytest.mark.parametrize("factory, layout", [
    (gpt2, autopar.Layout(dp=2, tp=2, zero=2)),
    (llama, autopar.Layout(tp=2, sequence_parallel=True)),
    (llama, autopar.Layout(dp=2, zero=3)),
    (gpt2, autopar.Layout(tp=2, pp=2, microbatches=2)),
])
def test_every_ranks_program_of_a_correct_layout_agrees(factory, layout):
    ex = factory(layers=2)
    assert autopar.check(ex.model, ex.batch, ex.loss_fn, layout) > 0


def _programs(layout):
    ex = gpt2(layers=1)
    tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
    out = {}
    for rank in range(layout.world_size):
        rewritten, _ = autopar.run_passes(tg, layout, options={"tp_rank": rank % layout.tp})
        out[rank] = to_program(rewritten, layout)
    return out


def _collective_nodes(program):
    return [n for n in program.gm.graph.nodes
            if any(isinstance(a, str) and a.startswith("autopar.mesh.") for a in n.args)]


def _check(programs):
    return check_collectives({r: program_collectives(p) for r, p in programs.items()},
                             programs[0].mesh)


def test_two_collectives_swapped_on_one_rank_are_refused():
    programs = _programs(autopar.Layout(dp=2, tp=2))
    assert _check(programs) > 0
    first, second = _collective_nodes(programs[3])[:2]
    assert first.args[0].meta["val"].shape != second.args[0].meta["val"].shape
    first.prepend(second)  # rank 3 issues its second collective first
    with pytest.raises(CollectiveMismatch, match=r"ranks 2 and 3 of one 'tp' group disagree at "
                                                 r"their collective 1 over 'tp' in step: rank 2 "
                                                 rf"runs \w+\(.* at node "
                                                 rf"{first.name} .*rank 3 runs .* at node "
                                                 rf"{second.name}"):
        _check(programs)


def test_a_shape_changed_on_one_rank_is_refused():
    programs = _programs(autopar.Layout(dp=2, tp=2))
    node = _collective_nodes(programs[1])[-1]
    source = node.args[0]
    with programs[1].gm.graph.inserting_before(node):
        narrowed = programs[1].gm.graph.call_function(torch.ops.aten.narrow.default,
                                                      (source, 0, 0, 1))
    narrowed.meta["val"] = source.meta["val"].narrow(0, 0, 1)
    node.replace_input_with(source, narrowed)
    with pytest.raises(CollectiveMismatch, match=rf"ranks 1 and 3 of one 'dp' group disagree .* "
                                                 rf"rank 1 runs all_reduce\(float32\[1\], sum\) "
                                                 rf"over 'dp' at node {node.name}"):
        _check(programs)


def test_a_collective_dropped_on_one_rank_is_refused():
    programs = _programs(autopar.Layout(dp=2, tp=2))
    node = _collective_nodes(programs[2])[-1]
    waits = list(node.users)
    for wait in waits:
        wait.replace_all_uses_with(node.args[0])
        programs[2].gm.graph.erase_node(wait)
    programs[2].gm.graph.erase_node(node)
    with pytest.raises(CollectiveMismatch, match=r"ranks 0 and 2 of one 'dp' group disagree .*"
                                                 r"rank 2 runs nothing \(its program has no "
                                                 r"more collectives there\)"):
        _check(programs)


def test_the_cli_checks_a_layout_without_launching(capsys):
    from autopar import cli

    assert cli.main(["check", "gpt2-tiny", "--dp", "2", "--tp", "2", "--zero", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "the 4 ranks' programs agree" in out and "collectives compared" in out
