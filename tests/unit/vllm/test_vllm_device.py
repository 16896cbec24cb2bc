"""The adapter's device signal (kv_connectors.vllm.device) and where it is passed: host KV needs
none (its bytes are in place when the op returns); the engine's side is tests/unit/engine/test_engine_device_order.py."""

from __future__ import annotations

import torch

from kv_connectors.vllm import connector, device


def test_host_memory_needs_no_signal():
    assert device.ready_signal(None) is None
    assert device.ready_signal(torch.device("cpu")) is None


class _Side:
    def __init__(self, layers: bool) -> None:
        self.layers = layers
        self.calls: list[tuple[str, object]] = []

    def writes_layers(self) -> bool:
        return self.layers

    def on_layer_saved(self, name, ready) -> None:
        self.calls.append((name, ready))

    def end_of_forward(self, ready) -> None:
        self.calls.append(("end", ready))


def _connector(side: _Side, monkeypatch) -> connector.KVConnector:
    c = object.__new__(connector.KVConnector)
    c._kv_device = torch.device("cuda", 0)  # type: ignore[attr-defined]
    monkeypatch.setattr(connector.KVConnector, "worker_side", property(lambda self: side))
    signals = iter(range(100))
    monkeypatch.setattr(device, "ready_signal", lambda dev: ("signal", dev.type, next(signals)))
    return c


def test_hooks_pass_a_device_signal_only_while_a_layer_wise_push_follows(monkeypatch):
    side = _Side(layers=True)
    c = _connector(side, monkeypatch)
    connector.KVConnector.save_kv_layer.__wrapped__(c, "layer.0", None, None)  # type: ignore[attr-defined]
    connector.KVConnector.wait_for_save.__wrapped__(c)  # type: ignore[attr-defined]
    assert side.calls == [("layer.0", ("signal", "cuda", 0)), ("end", ("signal", "cuda", 1))]
    side.layers, side.calls = False, []
    connector.KVConnector.save_kv_layer.__wrapped__(c, "layer.0", None, None)  # type: ignore[attr-defined]
    assert side.calls == [("layer.0", None)], "an event recorded per layer for nothing"
