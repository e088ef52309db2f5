"""The typed Record is what the statistics write: every key a record can carry is declared on it."""

from __future__ import annotations

import typing

import torch

from probes import StatisticsSubscriber, SubscriberManager, load_dump
from probes.dump import Record
from probes.dump.record import record_key
from probes.stats.numerics import summarize

DECLARED = set(typing.get_type_hints(Record))


def test_every_statistic_of_a_summary_is_a_declared_record_key():
    summary = summarize(torch.tensor([1.0, float("nan"), -2.0]))
    assert set(summary.to_dict()) <= DECLARED


def test_the_records_a_training_step_writes_use_only_declared_keys(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path / "d")]):
        model(torch.randn(2, 3)).sum().backward()
    records = load_dump(tmp_path / "d")
    assert records and all(set(record) <= DECLARED for record in records)
    assert len({record_key(record) for record in records}) == len(records)  # the key is unique
    assert {"forward", "backward"} == {record["phase"] for record in records}
