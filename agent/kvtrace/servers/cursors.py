"""Listings that go through the ledger once, however many pages a client takes (GetSnapshot).

A page used to be found by going through the whole ledger again for the entries after the last one sent: a
listing of N entries in pages of P cost N²/P entries read, and where the kernel keeps the ledger, each of those
was decoded from its maps (about 700 rows/s at 400 000 entries). A cursor instead keeps one pass open: the first
page starts it (LedgerStore.stream: a moment's view, read as it goes), each next page takes the following
entries from the same pass, and the token says which cursor and which page. Memory stays bounded: a pass over
the kernel's ledger holds one chunk of its map at a time; over a plain Ledger (a replay, `kvtrace run`,
--no-ledger-in-kernel) it holds a list of references to the entries that were live when it started (8 bytes
each, and what was freed since stays alive until the listing closes). A cursor remembers its last page to
answer a client that asks for it again (a retry); at most MAX_OPEN cursors are open, and one idle for
IDLE_SECONDS is closed at the next request. Pages come in the order the ledger is read (no order across pages
is promised), each entry once; entries allocated or freed while the listing goes on may or may not be in it, as
in any snapshot of a ledger that changes while it is read. (On kernels before 5.6, without batched map reads,
bcc walks the map key by key, and a walk whose key was freed meanwhile starts over: an entry may then come
twice.) A pass that fails (the maps went with the probes) closes its listing: the next page is CursorLost.
"""
from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# Open listings at once: the next one closes the least recently used (its client gets "start again"). Each holds
# its last page for a retry (up to 10 000 entries, about 300 bytes each) and a chunk of the map it reads: about
# 3 MB at most, 25 MB for all of them, whether their clients read on or went away.
MAX_OPEN = 8
# A listing nobody asked a page of for this long is closed.
IDLE_SECONDS = 60.0


class CursorLost(Exception):
    """The token names no open listing (closed when idle or crowded out, from another agent, or not a token)."""


class CursorMismatch(Exception):
    """The token names a listing that selects other processes or layers than the request."""


@dataclass
class _Cursor(Generic[T]):
    filters: Hashable  # what the listing selects: a page must ask for the same
    entries: Iterator[T]
    ahead: list[T] = field(default_factory=list)  # the entry read to know that another page follows
    sequence: int = 0  # pages sent
    last_page: list[T] = field(default_factory=list)
    used_monotonic: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)  # one page at a time per listing


class Cursors(Generic[T]):
    """Open listings by token (thread-safe: the gRPC server answers pages on several threads)."""

    def __init__(self, max_open: int = MAX_OPEN, idle_seconds: float = IDLE_SECONDS,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.max_open, self.idle_seconds, self._monotonic = max_open, idle_seconds, monotonic
        self._open: OrderedDict[str, _Cursor[T]] = OrderedDict()
        self._lock = threading.Lock()
        self.opened_total = 0
        self.lost_total = 0

    def page(self, token: str, filters: Hashable, start: Callable[[], Iterable[T]],
             page_size: int) -> tuple[list[T], str]:
        """The next `page_size` entries of the listing `token` names ("": a new listing, `start()` its pass),
        and the token of the page after ("" when this was the last). A token for a page already sent is
        answered with that page again; CursorLost where the token names no open listing, CursorMismatch where
        it names one that selects something else than `filters`. Where the pass's items are batches of entries
        (with a `count` and a `split(at)`: model.ledger.RowBatch), `page_size` counts their entries: a page is
        batches, the last one split where the page ends."""
        if not token:
            cursor_id, sequence = secrets.token_hex(8), 0
            cursor: _Cursor[T] = _Cursor(filters, iter(start()), used_monotonic=self._monotonic())
            with self._lock:
                self._close_idle()
                while len(self._open) >= self.max_open:
                    self._open.popitem(last=False)
                self._open[cursor_id] = cursor
                self.opened_total += 1
        else:
            cursor_id, sequence = _parse(token)
            with self._lock:
                self._close_idle()
                found = self._open.get(cursor_id) if cursor_id else None
                if found is None:
                    self.lost_total += 1
                    raise CursorLost(token)
                self._open.move_to_end(cursor_id)
            cursor = found
            if cursor.filters != filters:
                raise CursorMismatch("the page token belongs to a listing of other processes or layers")
        with cursor.lock:
            cursor.used_monotonic = self._monotonic()
            if sequence == cursor.sequence - 1:  # asked again (a retry): the same page
                page = cursor.last_page
            elif sequence == cursor.sequence:
                try:
                    page = _take(cursor, page_size)
                except BaseException:  # the pass is broken: its listing cannot go on whole
                    with self._lock:
                        self._open.pop(cursor_id, None)
                    raise
                cursor.sequence += 1
                cursor.last_page = page
            else:
                self.lost_total += 1
                raise CursorLost(token)
            more = bool(cursor.ahead)  # (the page asked for is the last one sent: ahead is what follows it)
        # A listing that has sent its last page stays open (idle) for a retry of that page, holding that page only.
        return page, f"{cursor_id}.{sequence + 1}" if more else ""

    def open_count(self) -> int:
        with self._lock:
            return len(self._open)

    def _close_idle(self) -> None:
        deadline = self._monotonic() - self.idle_seconds
        for cursor_id in [key for key, cursor in self._open.items() if cursor.used_monotonic < deadline]:
            del self._open[cursor_id]


def _take(cursor: _Cursor[T], page_size: int) -> list[T]:
    """The cursor's next page, and what follows it read ahead (one entry; or the rest of a batch, or the next
    batch with entries): whether a page follows is known."""
    first = cursor.ahead[0] if cursor.ahead else next(cursor.entries, None)
    if first is None or not hasattr(first, "split"):  # entries
        page = cursor.ahead if cursor.ahead else [] if first is None else [first]
        page += itertools.islice(cursor.entries, page_size - len(page))
        cursor.ahead = list(itertools.islice(cursor.entries, 1))
        return page
    batches: Iterator[Any] = itertools.chain((first,), cursor.entries)
    page, rows, cursor.ahead = [], 0, []
    for batch in batches:
        if not batch.count:
            continue
        if rows + batch.count > page_size:
            head, tail = batch.split(page_size - rows)
            page.append(head)
            cursor.ahead = [tail]
            return page
        page.append(batch)
        rows += batch.count
        if rows == page_size:
            following = next((batch for batch in batches if batch.count), None)
            cursor.ahead = [] if following is None else [following]
            break
    return page


def _parse(token: str) -> tuple[str, int]:
    """(cursor id, page number) of a token; ("", 0) for one that is no token of a cursor (never open)."""
    cursor_id, _, sequence = token.partition(".")
    if len(cursor_id) != 16 or not sequence.isdigit():
        return "", 0
    return cursor_id, int(sequence)
