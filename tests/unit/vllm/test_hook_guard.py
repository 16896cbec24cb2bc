"""No exception leaves a connector hook vLLM calls in its forward step (the worker would die)."""

from __future__ import annotations

from kv_connectors.nixl import NixlConnector


class _Exploding:
    def __getattr__(self, name: str):
        def boom(*args, **kwargs):
            raise OverflowError("Python int too large to convert to C long")

        return boom


def test_worker_hooks_log_and_carry_on_when_the_engine_raises(caplog):
    connector = NixlConnector.__new__(NixlConnector)  # only the worker side is exercised
    connector._worker = _Exploding()
    connector._sched = None
    connector._connector_metadata = None
    connector.start_load_kv(None)
    connector.save_kv_layer("layer.0", None, None)
    connector.wait_for_save()
    assert connector.get_finished(set()) == (None, None)
    result = connector.get_transfer_results(set())
    assert not result.finished_sending and not result.finished_recving
    assert "KV connector hook start_load_kv failed" in caplog.text
