"""bench.pb_calls' pure parts: the echo models' configs, and the pb_utils calls per request it
counts over the fake (the same code paths the orchestrator runs in a stub)."""

from __future__ import annotations

from pathlib import Path

from bench import pb_calls

ROOT = Path(__file__).resolve().parents[2]


def test_an_echo_model_has_pipelines_contract_and_batching_without_its_parameters():
    committed = (ROOT / "model_repository" / "pipeline" / "config.pbtxt").read_text()
    echo = pb_calls._echo_config("answer_send", committed)
    assert 'name: "answer_send"' in echo and 'name: "pipeline"' not in echo
    assert "parameters" not in echo and "string_value" not in echo
    for kept in ("max_batch_size", "dynamic_batching", "instance_group", 'name: "IMAGE"',
                 'name: "EMBEDDING"', 'backend: "python"'):
        assert kept in echo, kept
    assert echo.count("{") == echo.count("}")


def test_answers_returned_from_execute_make_no_round_trip_and_sent_ones_one_each():
    counts = pb_calls.calls_per_request()
    assert list(counts) == [label for label, *_ in pb_calls.SETUPS]
    for label, per_request in counts.items():
        assert per_request["InferenceResponse"] == 1.0, label
        expected = 0.5 if "sent at its deadline" in label else 0.0  # 1 of its 2 sent
        for call in ("get_response_sender", "send"):
            assert per_request.get(call, 0.0) == expected, (label, call)
        # execute's thread asks only of requests still unanswered in a batch older than 0.1 s: none
        # here but on a loaded host (an answered request is never asked).
        assert per_request.get("is_cancelled", 0.0) <= 0.1, label
    # Four requests per execute share their sub-requests (one group).
    assert counts["4 per execute, returned"]["exec"] < counts["1 per execute, returned"]["exec"]
