"""Counting XLA compilations in the tests (programs that must compile once per shape)."""

from __future__ import annotations

import contextlib

import jax

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def recorded_compilations(name_part: str = ""):
    """Yields a list that collects the ``fun_name`` of every XLA compilation (whose name contains ``name_part``) made
    inside the ``with`` block, e.g. ``["jit(_loraq_stacked)"]``."""
    compiled: list[str] = []

    def listener(event, duration, **kw):
        del duration
        if event == _COMPILE_EVENT and name_part in str(kw.get("fun_name")):
            compiled.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
