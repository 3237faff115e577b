"""A listing goes through the ledger once however many pages a client takes (servers/cursors.py)."""
import pytest

from kvtrace.servers.cursors import CursorLost, CursorMismatch, Cursors


class Pass:
    """A store's pass that counts how many times it was started and how many entries were read."""

    def __init__(self, count: int) -> None:
        self.count, self.starts, self.read = count, 0, 0

    def __call__(self):
        self.starts += 1
        for index in range(self.count):
            self.read += 1
            yield index


def take_all(cursors: Cursors, source: Pass, page_size: int, filters=("all",)) -> tuple[list, int]:
    token, entries, pages = "", [], 0
    while True:
        page, token = cursors.page(token, filters, source, page_size)
        entries += page
        pages += 1
        if not token:
            return entries, pages


@pytest.mark.parametrize("count,page_size,pages", [(0, 10, 1), (10, 10, 1), (11, 10, 2), (2305, 100, 24)])
def test_every_entry_once_in_one_pass(count, page_size, pages):
    cursors: Cursors[int] = Cursors()
    source = Pass(count)
    entries, taken = take_all(cursors, source, page_size)
    assert entries == list(range(count)) and taken == pages
    assert source.starts == 1 and source.read == count  # one pass, each entry read once
    assert cursors.open_count() == 1  # held (its last page only) for a retry, until idle or crowded out


@pytest.mark.parametrize("sizes,page_size,pages", [
    ((), 10, 1), ((0, 0), 10, 1), ((10,), 10, 1), ((4, 6), 10, 1), ((4, 6, 0, 0), 10, 1), ((4, 6, 0, 1), 10, 2),
    ((4096,) * 3 + (7,), 10000, 2), ((3, 0, 5, 2, 9, 0), 4, 5), ((25,), 1, 25)])
def test_batches_are_paged_by_their_entries_each_once(sizes, page_size, pages):
    """A pass in batches (a listing in columns: model.ledger.RowBatch): a page holds `page_size` entries, the
    last batch split where it ends; empty batches are passed over; a retry gets the same page."""
    from kvtrace.model.ledger import RowBatch

    starts = []

    def batches():
        starts.append(1)
        first = 0
        for size in sizes:
            yield RowBatch([list(range(first, first + size))] * 18, size)
            first += size

    cursors: Cursors[RowBatch] = Cursors()
    token, listed, taken = "", [], 0
    while True:
        page, following = cursors.page(token, "f", batches, page_size)
        again, following_again = cursors.page(token, "f", batches, page_size) if token else (page, following)
        assert [batch.columns[0] for batch in again] == [batch.columns[0] for batch in page]
        assert following_again == following
        assert sum(batch.count for batch in page) == (page_size if following else sum(sizes) - len(listed))
        listed += [row[0] for batch in page for row in batch.rows()]
        taken, token = taken + 1, following
        if not token:
            break
    assert listed == list(range(sum(sizes))) and taken == pages and len(starts) == 1


def test_a_page_asked_again_is_the_same_page_and_the_listing_goes_on():
    cursors: Cursors[int] = Cursors()
    source = Pass(25)
    first, token = cursors.page("", "f", source, 10)
    second, after = cursors.page(token, "f", source, 10)
    again, after_again = cursors.page(token, "f", source, 10)  # a retry
    assert again == second == list(range(10, 20)) and after_again == after
    last, end = cursors.page(after, "f", source, 10)
    assert last == list(range(20, 25)) and end == "" and source.read == 25


def test_lost_stale_foreign_and_crowded_out_tokens_say_so():
    now = [0.0]
    cursors: Cursors[int] = Cursors(max_open=2, idle_seconds=60, monotonic=lambda: now[0])
    _, token = cursors.page("", "f", Pass(30), 10)
    with pytest.raises(CursorMismatch, match="other processes"):
        cursors.page(token, "g", Pass(30), 10)  # the same listing with other filters
    with pytest.raises(CursorLost):
        cursors.page("0123456789abcdef.1", "f", Pass(30), 10)  # no such listing
    with pytest.raises(CursorLost):
        cursors.page("1,2,3,4", "f", Pass(30), 10)  # an old-style position token
    _, later = cursors.page(token, "f", Pass(30), 10)
    with pytest.raises(CursorLost):
        cursors.page(f"{token.split('.')[0]}.7", "f", Pass(30), 10)  # a page not yet reached
    cursors.page("", "f", Pass(30), 10)
    cursors.page("", "f", Pass(30), 10)  # a third listing: the least recently used closes
    with pytest.raises(CursorLost):
        cursors.page(later, "f", Pass(30), 10)
    _, idle = cursors.page("", "f", Pass(30), 10)
    now[0] = 61.0
    with pytest.raises(CursorLost):
        cursors.page(idle, "f", Pass(30), 10)  # idle for a minute
    assert cursors.lost_total == 5


def test_a_pass_that_breaks_closes_its_listing():
    """The maps went with the probes while a listing was open: the page fails, and so does every later one (list
    again), never an empty last page that would pass for the end of the listing."""
    def broken():
        yield from range(15)
        raise OSError("the map is gone")

    cursors: Cursors[int] = Cursors()
    first, token = cursors.page("", "f", broken, 10)
    assert first == list(range(10)) and token
    with pytest.raises(OSError):
        cursors.page(token, "f", broken, 10)
    with pytest.raises(CursorLost):
        cursors.page(token, "f", broken, 10)  # the retry
    assert cursors.open_count() == 0
