"""The item state machine: its table, and that the fetcher only ever takes its moves.

The table is checked on its own (every stage reachable from STAGED, terminal
stages without exits, and every open stage able to end), then the fetcher is
driven through the model tests' scenarios and the Hypothesis model itself with
every move recorded: each one is allowed, and together they take every move the
table allows (a move no scenario takes would be a stage the fetcher never uses).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from ec_scheduler.remote import Wanted
from ec_transfer_nixl.stages import NEXT, TERMINAL, IllegalMoveError, Stage
from ec_transfer_nixl.tasks import ItemFetch

Move = tuple[Stage, Stage]


def _load_model() -> ModuleType:
    """The model tests' module (their fakes, scenarios and Hypothesis machine)."""
    spec = importlib.util.spec_from_file_location(
        "fetcher_model_scenarios", Path(__file__).with_name("test_fetcher_model.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


model = _load_model()


def _reachable(start: Stage) -> set[Stage]:
    seen, todo = {start}, [start]
    while todo:
        for after in NEXT[todo.pop()]:
            if after not in seen:
                seen.add(after)
                todo.append(after)
    return seen


def test_the_table_names_every_stage_and_only_stages() -> None:
    assert set(NEXT) == set(Stage)
    assert all(after <= set(Stage) for after in NEXT.values())
    assert all(stage not in NEXT[stage] for stage in Stage), "no move to the same stage"


def test_every_stage_is_reachable_from_staged_and_can_reach_an_outcome() -> None:
    assert _reachable(Stage.STAGED) == set(Stage)
    for stage in Stage:
        assert _reachable(stage) & TERMINAL, f"{stage.name} can never end"


def test_landed_and_failed_are_the_terminal_stages_and_have_no_exits() -> None:
    assert {Stage.LANDED, Stage.FAILED} == TERMINAL
    for stage in TERMINAL:
        assert NEXT[stage] == frozenset()
    for stage in set(Stage) - TERMINAL:
        assert Stage.FAILED in NEXT[stage], f"an item {stage.name} can always fail"


def test_a_move_the_table_does_not_allow_raises() -> None:
    item = ItemFetch(Wanted("k", 1, 16))
    with pytest.raises(IllegalMoveError, match="STAGED to READING"):
        item.move(Stage.READING)
    item.decide("missing")
    assert item.stage is Stage.FAILED and item.outcome == "missing" and item.decided
    with pytest.raises(IllegalMoveError, match="FAILED to LOOKING_UP"):
        item.move(Stage.LOOKING_UP)


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[Move]:
    """Every move an item makes while the test runs, in order."""
    taken: list[Move] = []
    move = ItemFetch.move

    def recorded(item: ItemFetch, to: Stage) -> None:
        taken.append((item.stage, to))
        move(item, to)

    monkeypatch.setattr(ItemFetch, "move", recorded)
    return taken


def _scenarios() -> list[object]:
    """The model tests that drive a fetcher and take no argument."""
    return [
        test
        for name, test in vars(model).items()
        if name.startswith("test_") and callable(test) and not inspect.signature(test).parameters
    ]


def test_the_fetcher_takes_only_allowed_moves_and_every_one_of_them(moves: list[Move]) -> None:
    for scenario in _scenarios():
        scenario()  # type: ignore[operator]
    run_state_machine_as_test(
        model.FetchMachine,
        settings=settings(max_examples=60, stateful_step_count=40, deadline=None, derandomize=True),
    )
    allowed = {(stage, after) for stage, nexts in NEXT.items() for after in nexts}
    assert set(moves) <= allowed
    assert set(moves) == allowed, f"never taken: {sorted(allowed - set(moves), key=str)}"
