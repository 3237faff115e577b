"""The Session: what it keeps of the records sources hand it."""
from kvtrace.session import Session


def test_a_resent_layout_or_sleep_report_is_no_new_record():
    """The vLLM plugin sends its KV layout and sleep state again every 30 s (for an agent that restarted):
    the Session keeps the first, with its time, so that analysis sees no new sleep and no memory move."""
    from kvtrace.model.vllm import KvCacheLayout, KvTensor, SleepPool, SleepReport

    session = Session()
    layout = KvCacheLayout(7, 1_000, 0, (KvTensor(1 << 32, 1 << 20),), 11, 65536, 16)
    asleep = SleepReport(7, 2_000, 1, (SleepPool("weights", 1 << 20, 0),))
    session.ingest_many([layout, asleep])
    session.ingest_many([KvCacheLayout(7, 31_000, 0, (KvTensor(1 << 32, 1 << 20),), 11, 65536, 16),
                         SleepReport(7, 32_000, 1, (SleepPool("weights", 1 << 20, 0),))])
    view = session.vllm_view()
    assert view.layouts[7].timestamp_ns == 1_000 and view.sleeps[7] == (asleep,)
    awake = SleepReport(7, 40_000, 0, (SleepPool("weights", 1 << 20, 1 << 20),))
    session.ingest(awake)
    assert session.vllm_view().sleeps[7] == (asleep, awake)
