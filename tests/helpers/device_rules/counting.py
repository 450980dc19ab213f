"""Host synchronisations: counted with where they happen, labelled by training iteration, and
reported per rank."""

from __future__ import annotations

import collections
import json
import os
import traceback

from tests.helpers.device_rules.provenance import HERE, PROJECT, TORCH, short_path

# ---------------------------------------------------------------------------------- counting


class SyncCounter:
    """Host synchronisations, each with the label current when it happened (``mark``)."""

    def __init__(self):
        self.label: object = None
        self.events: list[tuple[object, str, str]] = []

    def mark(self, label) -> None:
        self.label = label

    def add(self, kind: str) -> None:
        self.events.append((self.label, kind, _where()))

    def by_label(self) -> dict:
        out: dict = collections.defaultdict(list)
        for label, kind, where in self.events:
            out[label].append((kind, where))
        return dict(out)

    def counts(self) -> dict:
        return {label: len(events) for label, events in self.by_label().items()}


def _where() -> str:
    """The innermost frame outside torch and this file, and the project's frame above it."""
    stack = traceback.extract_stack()[:-3]
    upstream = project = None
    for entry in reversed(stack):
        path = os.path.abspath(entry.filename)
        if path.startswith(HERE) or path.startswith(TORCH):
            continue
        if upstream is None:
            upstream = f"{short_path(path)}:{entry.lineno}"
        if path.startswith(PROJECT):
            project = f"{short_path(path)}:{entry.lineno}"
            break
    if project is None or project == upstream:
        return upstream or "?"
    return f"{upstream} (from {project})"


COUNTER = SyncCounter()


def counter() -> SyncCounter:
    """The process's counter (events of the installed rule)."""
    return COUNTER


def write_report(directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    events = [[label, kind, where] for label, kind, where in COUNTER.events]
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
        json.dump(events, f)


def read_report(directory: str) -> dict[int, list[tuple]]:
    """``{rank: [(label, kind, where), ...]}`` written by ``install(report=directory)``."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                out[int(name[4:-5])] = [tuple(e) for e in json.load(f)]
    return out


def assert_steady_syncs(directory: str, steady: list[int], ranks: int) -> None:
    """In the report ``directory`` of a training run on ``ranks`` processes: at most one host
    synchronisation per rank in each of the ``steady`` iterations (the ones found are listed
    with their places otherwise), and the one read of the step's statistics is seen. Prints
    the count of every iteration (``pytest -s``)."""
    events = read_report(directory)
    assert sorted(events) == list(range(ranks))
    for rank, found in events.items():
        per_iteration = collections.Counter(label for label, _, _ in found)
        print(f"rank {rank}: host synchronisations per iteration {dict(per_iteration)}")
        for iteration in steady:
            waits = [(kind, where) for label, kind, where in found if label == iteration]
            assert len(waits) <= 1, (rank, iteration, waits)
        assert per_iteration[steady[0]] >= 1
