"""Crash states of a trace under a persistence model.

``crash_states`` replays a trace over the tree it started from, asks the model which
operations are pending at the crash, and builds one ``DiskImage`` per chosen combination of
dropped / torn / kept operations, identical images merged.  ``crash_state`` rebuilds one of
them from its key.  Both are deterministic: same inputs (and seed), same states, same keys.

Choice of states: when at most ``exhaustive_limit`` operations are pending and the model
allows at most ``2 ** exhaustive_limit`` combinations, all of them; otherwise targeted ones
(all kept, none kept, every prefix in trace order, "drop op i but keep through j", one op
torn with the rest kept or dropped), each made valid for the model, plus ``random_states``
random ones drawn from ``random.Random(seed)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from faultinject.disk import DiskImage
from faultinject.explore import Builder, candidates, decode, describe, encode
from faultinject.fault_errors import ModelError
from faultinject.persistence import MODELS, Choice, PersistenceModel, Unit
from faultinject.replay import Replayed, replay
from faultinject.trace import TraceEvent


@dataclass(frozen=True)
class CrashState:
    """One disk a crash may leave.

    ``key`` rebuilds it with ``crash_state``; ``dropped`` and ``torn`` are the trace indexes of
    pending operations that did not persist, and of writes that persisted torn or as garbage.
    """

    key: str
    description: str
    image: DiskImage
    dropped: tuple[int, ...]
    torn: tuple[int, ...]
    model: str = ""


def get_model(model: str) -> PersistenceModel:
    try:
        return MODELS[model]
    except KeyError:
        raise ValueError(f"unknown persistence model {model!r}; known: {sorted(MODELS)}") from None


def _prepare(initial: DiskImage, events: Sequence[TraceEvent],
             model: str) -> tuple[PersistenceModel, Replayed, list[Unit]]:
    m = get_model(model)
    replayed = replay(initial, events)
    return m, replayed, m.units(replayed.ops)


def _state(m: PersistenceModel, replayed: Replayed, units: list[Unit], choice: Choice,
           image: DiskImage) -> CrashState:
    return CrashState(
        key=encode(units, choice),
        description=describe(m, replayed, units, choice),
        image=image,
        dropped=tuple(u.index for u, o in zip(units, choice, strict=True) if o == "d"),
        torn=tuple(u.index for u, o in zip(units, choice, strict=True) if o not in ("k", "d")),
        model=m.name,
    )


def pending_count(initial: DiskImage, events: Sequence[TraceEvent], model: str) -> int:
    """How many operations are not yet durable at the end of ``events`` under ``model``."""
    return len(_prepare(initial, events, model)[2])


def is_exhaustive(initial: DiskImage, events: Sequence[TraceEvent], model: str, *,
                  exhaustive_limit: int = 10) -> bool:
    """Whether ``crash_states`` enumerates every state the model allows for this trace."""
    m, _replayed, units = _prepare(initial, events, model)
    return len(units) <= exhaustive_limit and m.count(units) <= 2 ** exhaustive_limit


def crash_states(
    initial: DiskImage,
    events: Sequence[TraceEvent],
    model: str,
    *,
    exhaustive_limit: int = 10,
    random_states: int = 8,
    seed: int = 0,
) -> list[CrashState]:
    """The distinct disks a crash at the end of ``events`` may leave under ``model``.

    ``initial`` is the tree before the workload (``FaultyIO.initial``).  The first state is
    always the one where every pending operation persisted.  Raises ``ValueError`` for an
    unknown model or bad limits, ``ModelError`` if the trace cannot be replayed.
    """
    if exhaustive_limit < 0 or random_states < 0:
        raise ValueError("exhaustive_limit and random_states must be >= 0")
    m, replayed, units = _prepare(initial, events, model)
    builder = Builder(replayed, units)
    out: list[CrashState] = []
    seen_choices: set[Choice] = set()
    seen_images: set[DiskImage] = set()
    for choice in candidates(m, units, exhaustive_limit=exhaustive_limit,
                             random_states=random_states, seed=seed):
        if choice in seen_choices:
            continue
        seen_choices.add(choice)
        image = builder.image(choice)
        if image in seen_images:
            continue
        seen_images.add(image)
        out.append(_state(m, replayed, units, choice, image))
    return out


def crash_state(initial: DiskImage, events: Sequence[TraceEvent], model: str,
                key: str) -> CrashState:
    """Rebuild the state ``key`` names (``ModelError`` if the key names none)."""
    m, replayed, units = _prepare(initial, events, model)
    choice = decode(m, units, key)
    return _state(m, replayed, units, choice, Builder(replayed, units).image(choice))


__all__ = [
    "MODELS", "CrashState", "ModelError", "PersistenceModel", "crash_state", "crash_states",
    "get_model", "is_exhaustive", "pending_count",
]
