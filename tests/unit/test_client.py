"""The load client's reading of a stream and its inter-token latency."""

import asyncio

import httpx

from dspark.serve.client import _events, summarize


class _Reads(httpx.AsyncByteStream):
    """A response body that arrives in the given reads."""

    def __init__(self, reads: list[bytes]):
        self.reads = reads

    async def __aiter__(self):
        for chunk in self.reads:
            yield chunk


def _read_events(reads: list[bytes]) -> list[tuple[float, str]]:
    async def run():
        response = httpx.Response(200, stream=_Reads(reads))
        return [e async for e in _events(response, 0.0)]

    return asyncio.run(run())


def test_events_split_across_reads_share_the_time_of_the_read_that_completed_them():
    events = _read_events([b'data: {"a"', b": 1}\r\n\r\ndata: 2\n\ndata: 3\n", b"\ndata: [DONE]"])
    assert [data for _, data in events] == ['{"a": 1}', "2", "3", "[DONE]"]
    times = [t for t, _ in events]
    assert times[0] == times[1] == times[2]  # all three completed by the second read
    assert times[3] > times[2]


def _cell(chunks: list[list]) -> dict:
    rec = {"chunks": chunks, "tokens": [1, 2, 3, 4, 5, 6], "latency_s": 1.0}
    return {"records": [rec], "wall_s": 1.0}


def test_a_backlog_read_at_once_is_one_arrival_not_gaps_of_zero():
    # First token at 100 ms; three tokens read together at 130 ms; two chunks of one read at 160.
    fig = summarize(_cell([[0.1, 1], [0.13, 1], [0.13, 1], [0.13, 1], [0.16, 1], [0.16, 1]]))
    assert fig["ttft_p50_ms"] == 100.0
    assert fig["tokens"] == 6
    assert fig["itl_p50_ms"] == 10.0  # 30 ms over 3 tokens, then 30 ms over 2 is 15
    assert fig["itl_p99_ms"] == 15.0


def test_a_multi_token_chunk_spreads_its_gap():
    fig = summarize(_cell([[0.1, 1], [0.14, 4], [0.15, 1]]))
    assert fig["itl_p50_ms"] == 10.0
    assert fig["tokens"] == 6
