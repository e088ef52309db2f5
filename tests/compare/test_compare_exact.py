"""Bit-exact comparison: ``compare --exact`` by the records' hashes, and ``compare --ranks`` (every rank of one
dump against rank 0), on real training runs; a 1-ulp change in one weight is found where tolerances see none."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from probes import StatisticsSubscriber, SubscriberManager, load_dump
from probes.cli import main
from probes.compare import compare_dumps
from probes.compare.reading import MissingHashes
from probes.utils.phases import PARAMETER_PHASES

STEPS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # No bias in the first layer and one-hot inputs: its output holds weights as they are, so a 1-ulp change of
    # a weight shows in the first forward record (no rounding can absorb it).
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batch(step: int) -> torch.Tensor:
    return torch.eye(8)[torch.arange(4) * 2 % 8 + step % 2]


def _one_ulp_up(model: torch.nn.Module) -> None:
    """Moves one weight of the first layer (row 0, the column the first input selects) up by one ulp."""
    with torch.no_grad():
        weight = model[0].weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(float("inf")))


def _train(out: Path, *, ulp: bool = False, hash: bool = True, **options) -> None:
    model = _model()
    if ulp:
        _one_ulp_up(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(out, hash=hash, **options)]):
        for step in range(STEPS):
            optimizer.zero_grad()
            model(_batch(step)).square().mean().backward()
            optimizer.step()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exact")
    torch.set_num_threads(1)
    _train(root / "run")
    _train(root / "rerun")
    _train(root / "ulp", ulp=True)
    _train(root / "plain", hash=False)
    return root


def test_a_rerun_of_the_same_seed_is_bit_identical(runs):
    report = compare_dumps(runs / "run", runs / "rerun", exact=True)
    assert report.agrees and report.matched == len(load_dump(runs / "run")) > 0
    assert report.to_json()["bytes"] == "bit-identical"


def test_one_ulp_in_one_weight_is_found_by_exact_where_the_tolerances_agree(runs):
    assert compare_dumps(runs / "run", runs / "ulp").agrees  # 1 ulp is far inside rtol 1e-4
    report = compare_dumps(runs / "run", runs / "ulp", exact=True)
    first = report.first_divergence
    assert (first.rank, first.step, first.phase, first.name, first.metric) == (0, 0, "forward", "0.output.0", "hash")
    base, other = ({(r["step"], r["phase"], r["name"]): r["hash"] for r in load_dump(runs / name)}
                   for name in ("run", "ulp"))
    assert first.base == f"0x{base[0, 'forward', '0.output.0'] & (2**64 - 1):016x}" and first.base != first.other
    assert report.diverged_count == sum(base[key] != other[key] for key in base)
    assert report.to_json()["bytes"] == "differs in its bytes"
    assert "differs in its bytes" in str(first)


def test_exact_gives_the_same_answer_window_by_window(runs):
    whole = compare_dumps(runs / "run", runs / "ulp", exact=True, window=None)
    windowed = compare_dumps(runs / "run", runs / "ulp", exact=True, window=1, jobs=2)  # a window per step
    assert windowed.first_divergence == whole.first_divergence
    assert windowed.diverged_count == whole.diverged_count > 0
    assert windowed.divergences == whole.divergences


def test_exact_without_hashes_is_a_clear_error(runs, capsys):
    with pytest.raises(MissingHashes, match="hash=True"):
        compare_dumps(runs / "run", runs / "plain", exact=True)
    assert main(["compare", str(runs / "plain"), str(runs / "run"), "--exact"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("probes compare: error: ") and "hash=True" in err[0]


def test_the_cli_reports_bit_identical_and_differs_in_its_bytes(runs, tmp_path, capsys):
    assert main(["compare", str(runs / "run"), str(runs / "rerun"), "--exact"]) == 0
    assert "bit-identical" in capsys.readouterr().out
    html, report = tmp_path / "r.html", tmp_path / "r.json"
    assert main(["compare", str(runs / "run"), str(runs / "ulp"), "--exact", "--json", str(report),
                 "--html", str(html)]) == 1
    out = capsys.readouterr().out
    assert "DIVERGED at rank 0, step 0, forward, 0.output.0 (differs in its bytes)" in out
    document = json.loads(report.read_text())
    assert document["options"]["exact"] and document["first_divergence"]["metric"] == "hash"
    assert "differs in its bytes" in html.read_text()
    assert main(["show", str(runs / "run"), "--step", "0"]) == 0
    shown = capsys.readouterr().out
    first = load_dump(runs / "run")[0]
    assert f"0x{first['hash'] & (2**64 - 1):016x}" in shown


# ----------------------------------------------------------------------------------------------- --ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, runs) -> Path:
    """One dump, three ranks written by hand (RANK): 0 and 1 the same run, 2 with one weight 1 ulp up."""
    out = tmp_path_factory.mktemp("ranks") / "dump"
    saved = os.environ.get("RANK")
    try:
        for rank, ulp in ((0, False), (1, False), (2, True)):
            os.environ["RANK"] = str(rank)
            _train(out, ulp=ulp)
    finally:
        os.environ.pop("RANK") if saved is None else os.environ.__setitem__("RANK", saved)
    return out


def test_ranks_compares_every_rank_with_rank_0(ranks):
    report = compare_dumps(ranks, ranks=True, exact=True, phases=("forward", "backward"))
    first = report.first_divergence
    assert (first.rank, first.step, first.phase, first.name) == (2, 0, "forward", "0.output.0")
    per_rank = report.per_rank()
    assert per_rank[1] is None and per_rank[2] == first
    assert report.matched == 2 * len([r for r in load_dump(ranks) if r["rank"] == 0])
    # By tolerance the 1-ulp rank agrees too.
    assert compare_dumps(ranks, ranks=True, phases=["forward", "backward"]).agrees


def test_ranks_on_the_command_line(ranks, runs, capsys):
    assert main(["compare", str(ranks), "--ranks", "--exact", "--phase", "forward", "--phase", "backward"]) == 1
    out = capsys.readouterr().out
    assert "rank 1: bit-identical to rank 0" in out
    assert "rank 2: first divergence at rank 2 step 0 forward 0.output.0: differs in its bytes" in out
    assert main(["compare", str(ranks), "--ranks", "--exact", "--step", "0", "--name", "2.*",
                 "--phase", "backward"]) == 0  # the last layer's gradient: the same bytes on every rank
    capsys.readouterr()
    for argv, words in ((["compare", str(runs / "run"), "--ranks"], "at least one more rank"),
                        (["compare", str(ranks), "--ranks"], "no records of the phases compared (grad, param, optim)"),
                        (["compare", str(ranks), str(runs / "run"), "--ranks"], "give BASE only"),
                        (["compare", str(ranks)], "give the dump OTHER")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("probes compare: error: ") and words in err[0], (argv, err)


# ----------------------------------------------------------------------------------------------- DDP, 2 ranks

# Two set-ups: every rank the same data, activations compared; every rank its own data (real data
# parallelism), the parameter records compared: grad after the all-reduce, param after the update, optim.
SETUPS = {"same data": ({"hash": True}, ("forward", "backward"), (1, 2, "forward", "0.output.0")),
          "own data": ({"hash": True, "parameters": True, "optimizer_state": True}, None, (1, 2, "param", "0.weight"))}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ddp_worker(rank: int, port: int, out: str, perturb_rank: int, setup: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo")
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    record, _, _ = SETUPS[setup]
    with SubscriberManager().subscribe(ddp, [StatisticsSubscriber(out, **record)]):
        for step in range(STEPS):
            if step == 2 and rank == perturb_rank:  # an even step: its batch reads the weight's column
                _one_ulp_up(model)  # after DDP's broadcast: only this rank's weight moves
            optimizer.zero_grad()
            batch = _batch(step) if setup == "same data" else torch.randn(4, 8, generator=torch.Generator().manual_seed(
                100 * rank + step))  # each rank its own data
            ddp(batch).square().mean().backward()
            optimizer.step()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("setup", list(SETUPS))
def test_ddp_ranks_are_bit_identical_and_a_one_ulp_difference_on_one_rank_is_found(tmp_path, setup):
    _, COMPARED, expected = SETUPS[setup]
    for name, perturb in (("clean", -1), ("perturbed", 1)):
        torch.multiprocessing.start_processes(_ddp_worker, args=(_free_port(), str(tmp_path / name), perturb, setup),
                                              nprocs=2, join=True, start_method="spawn")
    clean = compare_dumps(tmp_path / "clean", ranks=True, exact=True, phases=COMPARED)
    compared = {r["phase"] for r in load_dump(tmp_path / "clean") if r["rank"] == 0} & set(COMPARED or PARAMETER_PHASES)
    assert clean.agrees and clean.matched == len([r for r in load_dump(tmp_path / "clean")
                                                  if r["rank"] == 0 and r["phase"] in compared]) > 0
    if setup == "own data":
        assert compared == set(PARAMETER_PHASES)
        assert not compare_dumps(tmp_path / "clean", ranks=True, phases=["forward"]).agrees  # the data differ
    found = compare_dumps(tmp_path / "perturbed", ranks=True, exact=True, phases=COMPARED)
    first = found.first_divergence
    assert (first.rank, first.step, first.phase, first.name) == expected
    assert main(["compare", str(tmp_path / "clean"), "--ranks", "--exact",
                 *(arg for phase in COMPARED or () for arg in ("--phase", phase))]) == 0
