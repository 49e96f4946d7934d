"""The serve benchmark's report: speedup per concurrency over no-draft, the side-by-side table and the plot."""

import json

import httpx

from dflash.bench import serve_load


def level(c, tps, tau):
    return {"concurrency": c, "requests": 4, "failed": 0, "wall_seconds": 1.0, "output_tokens": int(tps),
            "tokens_per_second": tps, "ttft_p50": 0.01, "ttft_p99": 0.02, "itl_p50": 0.003, "itl_p99": 0.009,
            "gap_p99": 0.02, "tau": tau}


def report():
    return {"command": "python -m dflash.bench serve --concurrency 1 2", "threads": 1, "requests": 4,
            "max_tokens": 8, "machine": {"cpu": "test", "nproc": 2},
            "modes": {"dflash": [level(1, 300.0, 4.0), level(2, 500.0, 3.9)],
                      "no-draft": [level(1, 100.0, 1.0), level(2, 400.0, 1.0)]}}


def test_speedup_per_concurrency_and_table(tmp_path):
    r = report()
    assert serve_load.speedups(r) == {"dflash": {1: 3.0, 2: 1.25}}
    md = serve_load.markdown(r)
    assert "| 1 | **3.00x** | 300.0 | 100.0 | 4.00 / 1.00 |" in md
    assert "| 2 | **1.25x** |" in md
    serve_load.plot(r, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_defaults_sweep_to_32():
    args = serve_load.parse_args([])
    assert args.concurrency == [1, 2, 4, 8, 16, 32] and args.modes == ["dflash", "no-draft"]


def test_a_level_over_rounds_takes_the_median_round_and_pools_latencies():
    def response(tokens, itl, error=False):
        return {"error": "x"} if error else {"tokens": tokens, "ttft": 0.1, "itl": itl, "gap": 0.2, "tau": 2.0,
                                             "chunks": tokens, "chunk_gaps": [itl] * (tokens - 1)}

    rounds = [{"responses": [response(100, 0.01), response(100, 0.01)], "wall_seconds": 1.0},  # 200 tok/s
              {"responses": [response(100, 0.02), response(100, 0.02)], "wall_seconds": 4.0},  # a disturbed round: 50
              {"responses": [response(100, 0.01), response(0, 0.0, error=True)], "wall_seconds": 0.5}]  # 200
    level = serve_load.summarise(8, rounds)
    assert level["round_tokens_per_second"] == [50.0, 200.0, 200.0] and level["tokens_per_second"] == 200.0
    assert level["requests"] == 6 and level["failed"] == 1 and level["output_tokens"] == 500
    assert level["itl_p99"] == 0.02 and level["wall_seconds"] == 5.5
    assert "3 rounds with the modes alternating" in serve_load.markdown(report() | {"rounds": 3})
    assert "chunk_gaps" not in level["responses"][0]  # pooled into the token gaps, not written per response


def test_token_gaps_give_each_token_of_a_burst_a_zero_wait():
    """A request whose 9 tokens came in 3 chunks (1 + 4 + 4: a speculative server's bursts) waited twice; its 8
    token gaps are those two waits and six zeros, so its p99 over tokens is its longest wait and its p50 is 0."""
    burst = {"tokens": 9, "chunks": 3, "chunk_gaps": [0.05, 0.04], "ttft": 0.1, "itl": 0.01, "gap": 0.05, "tau": 4.0}
    assert sorted(serve_load.token_gaps(burst)) == [0.0] * 6 + [0.04, 0.05]
    steady = {"tokens": 9, "chunks": 9, "chunk_gaps": [0.01] * 8, "ttft": 0.1, "itl": 0.01, "gap": 0.01, "tau": 1.0}
    level = serve_load.summarise(2, [{"responses": [burst, steady], "wall_seconds": 1.0}])
    assert level["token_gap_p50"] == 0.01 and level["token_gap_p99"] == 0.05 and level["token_gap_p90"] == 0.04


def _sse_client(*events: dict):
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, text=body)))


def test_a_stream_that_ends_in_an_error_event_counts_as_failed():
    """The server answers 200 before a failure and reports it as an error event: that request failed, it is not a
    completion of 0 tokens."""
    text = {"choices": [{"text": "x"}]}
    with _sse_client(text, {"error": {"message": "prefill failure: RuntimeError"}}) as client:
        assert serve_load.one_request(client, "http://s", "p", 8) == {"error": "prefill failure: RuntimeError"}
    with _sse_client(text) as client:
        assert "error" in serve_load.one_request(client, "http://s", "p", 8)  # (no usage: cut short)
    usage = {"choices": [], "usage": {"completion_tokens": 2}, "dflash": {"tau": 1.5}}
    with _sse_client(text, text, usage) as client:
        r = serve_load.one_request(client, "http://s", "p", 8)
    assert r["tokens"] == 2 and r["tau"] == 1.5 and r["itl"] is not None
    assert r["chunks"] == 2 and len(r["chunk_gaps"]) == 1 and serve_load.token_gaps(r) == r["chunk_gaps"]
