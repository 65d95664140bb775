"""The one shared check that a stateful stage resumes identically at every step."""
from __future__ import annotations

from typing import Any, Callable, Iterable


def assert_resumes_identically(make: Callable[[], Any], *, steps: Iterable[int] | None = None,
                               iterate: Callable[[Any], Iterable] = iter, same: Callable[[Any, Any], bool] | None = None):
    """``make()`` builds a fresh stage (iterable with ``state_dict`` / ``load_state_dict``).

    For each step ``k``: take ``k`` items, save the state, build a new stage, load the state and
    take the rest. The concatenation must equal one uninterrupted run. Returns that run.
    """
    full = list(iterate(make()))
    same = same or (lambda a, b: a == b)
    for k in (range(len(full) + 1) if steps is None else steps):
        stage = make()
        it = iter(iterate(stage))
        head = [next(it) for _ in range(k)]
        state = stage.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        rest = list(iterate(resumed))
        got = head + rest
        assert len(got) == len(full), f"resume after {k}: {len(got)} items, expected {len(full)}"
        for i, (a, b) in enumerate(zip(got, full)):
            assert same(a, b), f"resume after {k}: item {i} differs"
    return full
