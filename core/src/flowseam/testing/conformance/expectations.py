"""What a backend promises the conformance suite, and its file of expected failures.

A backend answers the hook :func:`flowseam.seam.hookspecs.flowseam_conformance_expectations` with a
:class:`flowseam.ConformanceExpectations`; :func:`resolve` fills in the defaults from the
backend's declarations, and :meth:`Expectations.mark_expected_failures` applies the
expected-failures file to the collected tests. That file is UTF-8 text, one entry per line:
a test id, whitespace, and a reason (required); blank lines and ``#`` comments are ignored::

    test_kernels.py::test_kernel_matches_oracle[tinyvendor-*-float64-*]  no float64 on the device

Every test the id matches (:func:`parse_xfail_file` has the rules) is marked
``xfail(strict=True)``: it must fail, so a fixed bug cannot hide behind a stale entry. Why a hook
and a file: docs/writing-a-backend.md, section 7.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from flowseam.seam.components import KINDS as ALL_KINDS  # every kind flowseam's cards use


@dataclass(frozen=True)
class XfailEntry:
    """One line of an expected-failures file."""

    pattern: str
    reason: str
    where: str  # "<file>:<line>"

    @property
    def regex(self) -> re.Pattern:
        return re.compile(".*".join(re.escape(part) for part in self.pattern.split("*")))

    def matches(self, test_id: str) -> bool:
        return self.regex.fullmatch(test_id) is not None


def parse_xfail_file(text: str, source: str = "<xfail file>") -> list[XfailEntry]:
    """Parse the expected-failures format (module docstring) into its entries.

    * The **test id** is the test's file name and name as pytest prints them
      (``<file>::<name>[<params>]``), without the directory, so it does not depend on where
      flowseam is installed. ``*`` matches any run of characters (the only wildcard; ``[`` and
      ``]`` are literal), e.g. ``*-float64-*`` for every float64 case, or ``flow_sde_step@*``
      for every arch rung of a host.
    * The **reason**, after whitespace, is required; pytest shows it in its report.
    * An entry that matches no collected test is reported as a warning
      (:meth:`Expectations.mark_expected_failures` returns those entries).

    :raises ValueError: for a line without a reason or a test id without ``::``, naming the line.
    """
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        where = f"{source}:{number}"
        if len(parts) < 2 or not parts[1].strip():
            raise ValueError(f"{where}: {line!r} has no reason; write '<test id> <why it fails>'")
        if "::" not in parts[0]:
            raise ValueError(f"{where}: {parts[0]!r} is not a test id; write "
                             "'<file>::<test name>[<params>]', e.g. "
                             "'test_kernels.py::test_kernel_matches_oracle[mybackend-*-float64-*]'")
        entries.append(XfailEntry(parts[0], parts[1].strip(), where))
    return entries


def read_xfail_file(path: Any) -> tuple[list[XfailEntry], str]:
    """Read an expected-failures file from a path or an ``importlib.resources`` Traversable.

    :returns: the entries and the file's name for messages.
    :raises OSError: if it cannot be read (a declared file must exist).
    """
    if isinstance(path, (str, os.PathLike)):
        path = Path(path)
    source = str(path)
    return parse_xfail_file(path.read_text(encoding="utf-8"), source), source


def conformance_test_id(item: Any) -> str:
    """The id an expected-failures entry is matched against: ``<file>::<name>[<params>]``."""
    return f"{Path(str(item.path)).name}::{item.nodeid.split('::', 1)[1]}"


@dataclass(frozen=True)
class Expectations:
    """A backend's resolved expectations (defaults filled in from its declarations).

    :ivar explicit: whether the backend answered ``flowseam_conformance_expectations``.
    :ivar overrides: kinds it must build itself; :data:`ALL_KINDS` for a ``"*"`` backend.
    :ivar falls_back: kinds it must leave to the next device (cpu).
    :ivar xfails: its expected failures; ``xfail_source`` names the file.
    :ivar torch_device: where the kernel checks put their input tensors.
    """

    backend: str
    explicit: bool
    overrides: frozenset[str]
    falls_back: frozenset[str]
    xfails: tuple[XfailEntry, ...] = ()
    xfail_source: str | None = None
    torch_device: str = "cpu"

    def placement(self, kind: str) -> str:
        """``"override"``, ``"fallback"`` or ``"either"`` (no promise: only a consistent record)."""
        if kind in self.overrides:
            return "override"
        if kind in self.falls_back:
            return "fallback"
        return "either"

    def mark_expected_failures(self, items: Iterable[Any]) -> list[XfailEntry]:
        """Mark each item listed in the expected-failures file strict xfail.

        :returns: the entries that matched no item (stale, or written for another host).
        """
        import pytest

        used: set[XfailEntry] = set()
        for item in items:
            tid = conformance_test_id(item)
            for entry in self.xfails:
                if entry.matches(tid):
                    used.add(entry)
                    item.add_marker(pytest.mark.xfail(
                        reason=f"{entry.reason} (expected failure, {entry.where})", strict=True))
                    break
        return [e for e in self.xfails if e not in used]


def resolve(record: Any, registry: Any) -> Expectations:
    """Ask the backend of ``record`` for its expectations and fill in the defaults.

    :raises TypeError: if the hook returns something other than ConformanceExpectations/None.
    :raises ValueError, OSError: for a malformed or unreadable expected-failures file.
    """
    from flowseam.seam.declarations import ConformanceExpectations

    answer = registry.call(record, "flowseam_conformance_expectations")
    if answer is not None and not isinstance(answer, ConformanceExpectations):
        raise TypeError(f"flowseam_conformance_expectations() of {record.name!r} returned "
                        f"{answer!r}; expected flowseam.ConformanceExpectations or None")
    explicit = answer is not None
    answer = answer or ConformanceExpectations()
    declared = set(record.component_kinds)
    every = "*" in declared
    overrides = (set(answer.overrides) if answer.overrides is not None
                 else set(ALL_KINDS) if every else declared)
    falls_back = (set(answer.falls_back) if answer.falls_back is not None
                  else set() if every else set(ALL_KINDS) - declared - overrides)
    xfails: list[XfailEntry] = []
    source = None
    if answer.xfail_file is not None:
        xfails, source = read_xfail_file(answer.xfail_file)
    return Expectations(
        backend=record.name, explicit=explicit, overrides=frozenset(overrides),
        falls_back=frozenset(falls_back), xfails=tuple(xfails), xfail_source=source,
        torch_device=answer.torch_device or "cpu")
