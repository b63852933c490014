"""Requests with ``n > 1``: their samples start in the same engine step.

vLLM fans a request with ``n`` samples out into ``n`` child requests (``"{i}_{parent id}"``) and
sends each to the engine core on its own; the engine core admits whatever has arrived when it
schedules a step. So one child may prefill alone and decode one step with its siblings' prompts
still in flight, another time all ``n`` start together: which happens depends on microseconds.
Plain vLLM computes a row the same way whatever shares its step, so it never shows. With batch-
aware routing a decode row's experts depend on the other rows of its step (that is the method),
so the same seeded request gave different samples from run to run.

The fix holds the siblings back until all ``n`` are in, then admits them together: a request
alone on the server then meets the same steps every time. The calling process stamps each child
with ``n`` (``InputProcessor.process_inputs``, where the request's private sampling parameters
are made); the engine core's scheduler holds stamped requests until their group is complete
(``Scheduler.add_request``) and forgets held ones that are aborted (``Scheduler.finish_requests``).
Nothing waits on a timer: the siblings are sent back to back, and while a group is incomplete
the engine core simply has nothing new to schedule for it.
"""

from __future__ import annotations

# extra_args key the calling process sets on every child of an n > 1 request: the group's size
GROUP_KEY = "sere_siblings"


def stamp(request) -> None:
    """Mark ``request`` (an ``EngineCoreRequest`` with its own sampling parameters) with its
    sample count, when it has more than one."""
    params = getattr(request, "sampling_params", None)
    n = getattr(params, "n", 1)
    if params is None or n <= 1:
        return
    params.extra_args = {**(params.extra_args or {}), GROUP_KEY: n}


def group_of(request) -> tuple[str, int] | None:
    """``(group, size)`` of a stamped request, else None: a child of an n > 1 request (stamped with
    ``n``; its group is the parent id in ``"{i}_{parent id}"``), or any request stamped with
    ``{"group": id, "size": n}`` (the engine evaluation's batches, whose B sequences must start in
    one step as well)."""
    params = getattr(request, "sampling_params", None)
    stamp_ = ((params.extra_args or {}) if params is not None else {}).get(GROUP_KEY)
    if isinstance(stamp_, dict):
        group, size = stamp_.get("group"), stamp_.get("size")
        return (str(group), size) if isinstance(size, int) and size > 1 and group is not None else None
    index, sep, parent = request.request_id.partition("_")
    if not isinstance(stamp_, int) or stamp_ <= 1 or not sep or not index.isdigit():
        return None
    return parent, stamp_


class Gate:
    """Per scheduler: the children of incomplete groups, held back from the waiting queue."""

    def __init__(self):
        self.held: dict[str, list] = {}  # parent id -> children that arrived

    def admit(self, request) -> list:
        """The requests to hand the scheduler now: ``[request]`` unless it belongs to an incomplete
        group; the whole group, in arrival order, when its last child arrives."""
        group = group_of(request)
        if group is None:
            return [request]
        parent, n = group
        arrived = self.held.setdefault(parent, [])
        arrived.append(request)
        if len(arrived) < n:
            return []
        del self.held[parent]
        return arrived

    def forget(self, request_ids) -> None:
        """Drop held children that are aborted (``None``: all)."""
        if request_ids is None:
            self.held.clear()
            return
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        for parent in list(self.held):
            self.held[parent] = [r for r in self.held[parent] if r.request_id not in ids]
            if not self.held[parent]:
                del self.held[parent]
